{{/* Names and labels shared by every template. */}}

{{- define "inflight.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "inflight.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Component names leave room for the ReplicaSet and pod suffixes. */}}
{{- define "inflight.gateway.fullname" -}}
{{- printf "%s-gateway" (include "inflight.fullname" . | trunc 45 | trimSuffix "-") -}}
{{- end -}}

{{- define "inflight.worker.fullname" -}}
{{- printf "%s-worker" (include "inflight.fullname" . | trunc 46 | trimSuffix "-") -}}
{{- end -}}

{{- define "inflight.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "inflight.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: inflight
{{- end -}}

{{/* Selector labels: call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "inflight.selectorLabels" -}}
app.kubernetes.io/name: {{ include "inflight.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "inflight.componentLabels" -}}
{{ include "inflight.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "inflight.worker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "inflight.worker.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "inflight.secretName" -}}
{{- default (printf "%s-secrets" (include "inflight.fullname" .)) .Values.existingSecret -}}
{{- end -}}

{{/* image: call with (dict "image" .Values.gateway.image "ctx" $). A digest wins over the tag. */}}
{{- define "inflight.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "inflight.servedModelName" -}}
{{- default (base .Values.model.path) .Values.model.servedModelName -}}
{{- end -}}

{{/* Worker grace period: long enough for preStop plus the whole drain, with a margin to exit. */}}
{{- define "inflight.worker.terminationGracePeriodSeconds" -}}
{{- $w := .Values.worker -}}
{{- $needed := add $w.drainTimeoutSeconds $w.preStopSleepSeconds -}}
{{- if kindIs "invalid" $w.terminationGracePeriodSeconds -}}
{{- add $needed 30 -}}
{{- else if le (int $w.terminationGracePeriodSeconds) (int $needed) -}}
{{- fail (printf "worker.terminationGracePeriodSeconds (%d) must be greater than worker.drainTimeoutSeconds + worker.preStopSleepSeconds (%d): the kubelet would kill generations still draining" (int $w.terminationGracePeriodSeconds) (int $needed)) -}}
{{- else -}}
{{- $w.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{- define "inflight.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "inflight.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Environment both components share: pod identity, telemetry and the credentials both use. */}}
{{- define "inflight.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"
- name: INFLIGHT_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "inflight.secretName" . }}
      key: INFLIGHT_REDIS_PASSWORD
      optional: true
- name: INFLIGHT_KAFKA_SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ include "inflight.secretName" . }}
      key: INFLIGHT_KAFKA_SASL_USERNAME
      optional: true
- name: INFLIGHT_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "inflight.secretName" . }}
      key: INFLIGHT_KAFKA_SASL_PASSWORD
      optional: true
{{- end -}}

{{- define "inflight.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end -}}

{{- define "inflight.gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- include "inflight.gateway.fullname" . -}}
{{- else -}}
default
{{- end -}}
{{- end -}}

{{/* Gateway grace period: preStop, then uvicorn's graceful shutdown of open streams, then a margin. */}}
{{- define "inflight.gateway.terminationGracePeriodSeconds" -}}
{{- $g := .Values.gateway -}}
{{- $needed := add $g.drainTimeoutSeconds $g.preStopSleepSeconds -}}
{{- if kindIs "invalid" $g.terminationGracePeriodSeconds -}}
{{- add $needed 10 -}}
{{- else if le (int $g.terminationGracePeriodSeconds) (int $needed) -}}
{{- fail (printf "gateway.terminationGracePeriodSeconds (%d) must be greater than gateway.drainTimeoutSeconds + gateway.preStopSleepSeconds (%d): the kubelet would cut streams still draining" (int $g.terminationGracePeriodSeconds) (int $needed)) -}}
{{- else -}}
{{- $g.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/*
Fail closed: no key source (apiKeys, or existingSecret, which must then hold INFLIGHT_API_KEYS) fails
the render unless auth.allowAnonymous says an open gateway is meant. Not tied to the exposure: a
NetworkPolicy still admits every pod of the namespace, and the exposure can change after install.
*/}}
{{- define "inflight.checkAuth" -}}
{{- if not (or .Values.apiKeys .Values.existingSecret .Values.auth.allowAnonymous) -}}
{{- fail "no API keys: the gateway would accept every request. Set apiKeys, or existingSecret naming a Secret that holds INFLIGHT_API_KEYS; to run an open gateway on purpose, set auth.allowAnonymous=true" -}}
{{- end -}}
{{- end -}}

{{/* The gateway's INFLIGHT_API_KEYS reference may be missing only when an open gateway was chosen. */}}
{{- define "inflight.apiKeysOptional" -}}
{{- and .Values.auth.allowAnonymous (not .Values.apiKeys) -}}
{{- end -}}

{{/*
The peers admitted to the metrics ports: networkPolicy.metricsFrom when given, else every pod of the
namespace named networkPolicy.metricsNamespace (matched by the label Kubernetes gives every namespace).
Without either the render fails: an empty namespace selector would admit every namespace of the cluster.
*/}}
{{- define "inflight.metricsPeers" -}}
{{- $np := .Values.networkPolicy -}}
{{- if $np.metricsFrom -}}
{{- toYaml $np.metricsFrom }}
{{- else -}}
{{- if not $np.metricsNamespace -}}
{{- fail "networkPolicy.metricsNamespace is empty: the metrics ports would be open to every namespace. Name your Prometheus's namespace there, or list the scrapers in networkPolicy.metricsFrom" -}}
{{- end -}}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ $np.metricsNamespace | quote }}
{{- end -}}
{{- end -}}

{{/* The worker's /cache claim: the operator's own, else the one worker-cache-pvc.yaml creates. */}}
{{- define "inflight.worker.cacheClaim" -}}
{{- .Values.worker.cacheVolume.existingClaim | default (printf "%s-cache" (include "inflight.worker.fullname" .)) -}}
{{- end -}}
