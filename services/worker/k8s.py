"""Kubernetes-native scale-in: keep this pod's deletion cost in step with its load.

When a Deployment (or KEDA through it) scales in, the ReplicaSet controller deletes the pods with the
lowest `controller.kubernetes.io/pod-deletion-cost` first. A worker that publishes its number of
in-flight requests there is therefore removed only after the idle ones, so scale-in cuts few
generations short. The annotation is best effort: a failed PATCH is logged and retried with the next
update, never raised into the serving path.

Every PATCH is a write to the API server (and an update event for every pod watcher), so writes are
throttled on the trailing edge: at most one per `min_interval_s`, only when the value changed, and the
last value of a burst is always written once the interval has passed (an idle pod must end up at 0).
The blocking client call runs in a thread so the worker's I/O loop never waits on the API server.

Outside a cluster (no KUBERNETES_SERVICE_HOST, or no POD_NAME / POD_NAMESPACE from the downward API),
or without a mounted service-account token, `PodDeletionCost.from_env()` returns a disabled instance
whose `update` does nothing. The deployments leave it off by default (no token mounted): RBAC cannot
restrict the `patch pods` it needs to the worker's own pod, whose name is generated. Inside one, the
`kubernetes` client (seconds to import and set up) is built on the first write, in the worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
# A strategic merge patch on metadata.annotations touches this one key and leaves the others alone.
PATCH_CONTENT_TYPE = "application/strategic-merge-patch+json"
SERVICE_TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"
SERVICE_CA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
# The API server stores the cost as an int32.
_INT32_MAX = 2**31 - 1
_REQUEST_TIMEOUT_S = 5.0


def in_cluster(environ: Mapping[str, str]) -> bool:
    """True when the process runs in a pod that knows its own name and namespace."""
    return all(environ.get(name) for name in ("KUBERNETES_SERVICE_HOST", "POD_NAME", "POD_NAMESPACE"))


def _incluster_api(environ: Mapping[str, str], token_path: str, ca_path: str) -> Any:
    """A CoreV1Api authenticated as the pod's service account."""
    from kubernetes import client
    from kubernetes.config.incluster_config import InClusterConfigLoader

    configuration = client.Configuration()
    InClusterConfigLoader(token_path, ca_path, environ=environ).load_and_set(configuration)
    return client.CoreV1Api(client.ApiClient(configuration))


class PodDeletionCost:
    """Publishes a load figure as this pod's deletion cost; a no-op when `api_factory` is None.

    `api_factory` returns a `kubernetes.client.CoreV1Api`; it is called once, off the event loop.
    """

    def __init__(
        self,
        api_factory: Callable[[], Any] | None,
        pod_name: str = "",
        namespace: str = "",
        *,
        min_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        if api_factory is not None and not (pod_name and namespace):
            raise ValueError("pod_name and namespace are required when an API client is given")
        self._api_factory = api_factory
        self._api: Any | None = None  # built by the first _patch
        self.pod_name = pod_name
        self.namespace = namespace
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._desired: int | None = None  # latest value asked for
        self._published: int | None = None  # last value the API server accepted
        self._last_attempt: float | None = None  # clock() of the last PATCH, successful or not
        # The one writer task (so writes land in order): sleeps out the interval, then PATCHes.
        self._flush: asyncio.Task[None] | None = None

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        token_path: str = SERVICE_TOKEN_PATH,
        ca_path: str = SERVICE_CA_PATH,
        min_interval_s: float = 5.0,
    ) -> PodDeletionCost:
        """An enabled instance inside a cluster (service-account credentials), else a no-op one."""
        env = dict(os.environ if environ is None else environ)
        if not in_cluster(env):
            return cls(None, min_interval_s=min_interval_s)
        if not os.path.isfile(token_path):
            # How the chart and the kustomize base turn the feature off (their default): no token is
            # mounted, because the Role it needs could patch any pod of the namespace.
            log.info("pod-deletion-cost: off (no service account token at %s)", token_path)
            return cls(None, min_interval_s=min_interval_s)
        factory = functools.partial(_incluster_api, env, token_path, ca_path)
        return cls(factory, env["POD_NAME"], env["POD_NAMESPACE"], min_interval_s=min_interval_s)

    @property
    def enabled(self) -> bool:
        return self._api_factory is not None

    @property
    def published(self) -> int | None:
        """The last value the API server accepted (None before the first write)."""
        return self._published

    async def update(self, load: int) -> None:
        """Record the current load; it is written in the background, at once or after the interval.

        Never waits on the API server: callers sit on the request path.
        """
        if self._api_factory is None:
            return
        self._desired = max(0, min(int(load), _INT32_MAX))
        if self._flush is not None and not self._flush.done():
            return  # the pending write will pick up the latest value
        self._flush = asyncio.create_task(self._publish_after(max(0.0, self._wait_s())))

    async def flush(self) -> None:
        """Wait for the pending write, if any (tests; a shutdown that wants the last value out)."""
        if self._flush is not None:
            await self._flush

    async def aclose(self) -> None:
        """Cancel a pending trailing-edge write (call on shutdown)."""
        if self._flush is not None:
            self._flush.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flush
            self._flush = None

    def _wait_s(self) -> float:
        if self._last_attempt is None:
            return 0.0
        return self._last_attempt + self.min_interval_s - self._clock()

    async def _publish_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        # The load may change while a PATCH is in flight: keep going until the last value is out.
        while self._desired is not None and self._desired != self._published:
            if not await self._publish(self._desired):
                # Not retried on its own (a missing RBAC rule would make that a PATCH loop): the
                # next update() tries again.
                return
            if self._desired != self._published:
                await asyncio.sleep(max(0.0, self._wait_s()))

    async def _publish(self, value: int) -> bool:
        self._last_attempt = self._clock()
        try:
            await asyncio.to_thread(self._patch, value)
        except Exception as exc:  # best effort: a stale cost only makes scale-in less precise
            log.warning("pod-deletion-cost: PATCH %s/%s failed: %s", self.namespace, self.pod_name, exc)
            return False
        self._published = value
        return True

    def _patch(self, value: int) -> None:
        if self._api is None:
            assert self._api_factory is not None
            self._api = self._api_factory()
        body = {"metadata": {"annotations": {DELETION_COST_ANNOTATION: str(value)}}}
        self._api.patch_namespaced_pod(
            self.pod_name,
            self.namespace,
            body,
            _content_type=PATCH_CONTENT_TYPE,
            _request_timeout=_REQUEST_TIMEOUT_S,
        )
