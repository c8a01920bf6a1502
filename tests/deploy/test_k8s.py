"""The Kubernetes manifests (``deploy/k8s``) held to the code, never by eye: every overlay rendered
by the real ``kubectl kustomize`` and validated strictly against a current Kubernetes schema
(kubernetes-validate); every container of our image parsed by ``stage``'s own argument parser and
its config built (a flag that does not exist, or a bad value, fails here); every port a manifest
names is one the process listens on; secrets never on a command line; PDBs, topology spread, GPU
and CPU/memory requests, and the drain arithmetic (preStop + --shutdown-grace-s < the grace period).

That each role answers its probe paths on a real server is ``test_k8s_run.py``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
from argparse import Namespace
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate
import pytest

from cli.router import router_config
from router.openapi import document
from cli import build_parser
from cli.serve import server_config
from tests.deploy.k8s_manifests import (GPU_OVERLAYS, OVERLAYS, compose, container_env, expand, load_yaml, name, ours,
                                        references, render, secret_values, secret_vars, selects, workloads)

STAGE_ROLES = ("encoder", "prefill", "decode", "pd")
CONTAINERFILE = Path(__file__).resolve().parents[2] / "deploy" / "Containerfile"
PROMETHEUS = CONTAINERFILE.parent / "prometheus"  # scrape-kubernetes.yml: the `role` label the rules group by
DRAIN_MARGIN_S = 10  # past --shutdown-grace-s, aborted requests get 5 s to end, then the lifespan stops
SECRET_FLAGS = ("--admin-token", "--redis-url")  # their values never go in args (the -file flags may)
_DISCOVER = re.compile(r"^(\w+)=dns://([a-z0-9-]+):(\d+)$")  # a Service of the pod's namespace, by its short name


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def parse(argv: list[str]) -> Namespace:
    """``stage ARGV`` through the CLI's own parser; an unknown flag or a bad value fails with its error."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"stage {' '.join(argv)}\n{err.getvalue()}")


def commands(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], Namespace, dict[str, str]]]:
    """(workload, container, parsed args, env) of every container of our image, args expanded as
    Kubernetes expands them (sample pod IP, namespace and secrets) and the config built from them
    under that environment, as ``stage`` builds it: a bad value fails here."""
    secrets = secret_values(objects)
    out = []
    for workload, spec, _ in workloads(objects):
        for container in ours(spec):
            assert "command" not in container, f"{workload}: our image's entrypoint is `stage`; give args only"
            env = container_env(container, secrets)
            args = parse([expand(arg, env) for arg in container["args"]])
            with mock.patch.dict(os.environ, env, clear=True):
                try:
                    check_config(args)
                except ValueError as exc:
                    pytest.fail(f"{workload} {container['name']}: {exc}")
            out.append((workload, container, args, env))
    return out


def check_config(args: Namespace) -> None:
    if args.command != "serve":
        return
    if args.role == "router":
        router_config(args)
    else:
        server_config(args, args.role)


def serving(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], Namespace, dict[str, str]]]:
    return [c for c in commands(objects) if c[2].command == "serve"]


def listening(args: Namespace) -> dict[str, int]:
    """The ports the process of ``args`` listens on, by the containerPort name the manifests give them."""
    ports = {"http": args.port}
    if args.role in ("prefill", "pd"):
        ports["bootstrap"] = args.bootstrap_port
    return ports


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_kubernetes_schema_strictly(rendered, overlay):
    check_schema(rendered[overlay], overlay)


def check_schema(objects: list[dict[str, Any]], overlay: str) -> None:
    version = kubernetes_validate.latest_version()
    errors = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name(obj)}: {exc.message} at {list(exc.path)}")
    assert errors == [], "\n".join(errors)
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds


def test_the_overlays_run_the_roles_the_issue_asks_for(rendered):
    roles = {overlay: sorted(args.role for _, _, args, _ in serving(objects)) for overlay, objects in rendered.items()}
    assert roles == {"epd": ["decode", "encoder", "prefill", "router"],
                     "pd": ["decode", "pd", "prefill", "router"],
                     "cpu-demo": ["decode", "encoder", "prefill", "router"]}
    redis = {overlay: [name(o) for o in objects if o["kind"] == "StatefulSet"] for overlay, objects in rendered.items()}
    assert redis == {"epd": ["StatefulSet/epd-redis"], "pd": [], "cpu-demo": ["StatefulSet/epd-redis"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_ports_probes_and_scrape_annotations_are_the_ports_the_code_listens_on(rendered, overlay):
    check_ports(rendered[overlay], overlay)


def check_ports(objects: list[dict[str, Any]], overlay: str) -> None:
    annotations = {name(o): o["spec"]["template"]["metadata"].get("annotations", {})
                   for o in objects if o["kind"] == "Deployment"}
    for workload, container, args, _ in serving(objects):
        ports = listening(args)
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert declared == ports, f"{workload}: containerPorts {declared}, `stage serve {args.role}` listens on {ports}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                port = container[probe]["httpGet"]["port"]
                assert declared.get(port, port) == args.port, f"{workload} {probe}: port {port}, HTTP is on {args.port}"
        assert annotations[workload] == {"prometheus.io/scrape": "true", "prometheus.io/port": str(args.port),
                                         "prometheus.io/path": "/metrics"}, workload


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_probes_paths_it_serves(rendered, overlay):
    check_probe_paths(rendered[overlay], overlay)


def check_probe_paths(objects: list[dict[str, Any]], overlay: str) -> None:
    paths = set(document(None)["paths"])
    for workload, container, args, _ in serving(objects):
        if args.role == "router":
            probes = {p: container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
            assert probes == {"startupProbe": "/server_info", "readinessProbe": "/health",
                              "livenessProbe": "/server_info"}, workload
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] > args.startup_timeout_s, (
                f"{workload}: the startup probe gives up before --startup-timeout-s {args.startup_timeout_s}")
            assert set(probes.values()) | {"/metrics"} <= paths
        else:  # what each stage answers on them is test_k8s_run.py's, on real servers
            probes = {p: container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
            assert set(probes.values()) == {"/health"}, workload


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_server_takes_its_traces_endpoint_from_the_optional_tracing_configmap(rendered, overlay):
    """Tracing is off until an operator creates the ConfigMap ``epd-tracing`` (docs/observability.md):
    every server reads ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` from its optional key, and with the key
    set, each one's config traces to it."""
    expected = {"name": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "valueFrom": {"configMapKeyRef": {
        "name": "epd-tracing", "key": "otlp-traces-endpoint", "optional": True}}}
    for workload, container, args, env in serving(rendered[overlay]):
        assert expected in container["env"], workload
        with mock.patch.dict(os.environ, env, clear=True):
            config = router_config(args) if args.role == "router" else server_config(args, args.role)
        assert config.tracing.endpoint == env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"], workload


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_servers_bind_the_pod_address_from_the_downward_api(rendered, overlay):
    check_pod_address(rendered[overlay], overlay)


def check_pod_address(objects: list[dict[str, Any]], overlay: str) -> None:
    for workload, container, args, env in serving(objects):
        pod_ip = env["POD_IP"]
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
        assert args.host == pod_ip, f"{workload}: --host {args.host}"
        if args.role in ("prefill", "decode", "pd"):
            assert args.transfer_host == pod_ip, f"{workload}: --transfer-host {args.transfer_host}"
        if args.role in ("prefill", "pd"):
            assert args.bootstrap_host == pod_ip, f"{workload}: --bootstrap-host {args.bootstrap_host}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_discovers_every_stage_through_its_headless_service(rendered, overlay):
    check_discovery(rendered[overlay], overlay)


def check_discovery(objects: list[dict[str, Any]], overlay: str) -> None:
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    pods = {w: labels for w, _, labels in workloads(objects)}
    stages = {w: args for w, _, args, _ in serving(objects) if args.role != "router"}
    (router,) = [args for _, _, args, _ in serving(objects) if args.role == "router"]
    found = set()
    for entry in router.discover:
        match = _DISCOVER.match(entry)
        assert match, f"--discover {entry}: expected ROLE=dns://SERVICE:PORT"
        role, service, port = match.group(1), match.group(2), int(match.group(3))
        assert services[service]["spec"].get("clusterIP") == "None", f"{service} must be headless (one record a pod)"
        selected = [w for w in stages if selects({"matchLabels": services[service]["spec"]["selector"]}, pods[w])]
        assert len(selected) == 1, f"{service} selects {selected}"
        args = stages[selected[0]]
        assert args.role in (role, "pd"), f"--discover {role}= names {selected[0]}, a {args.role}"
        assert args.port == port, f"--discover {entry}: {selected[0]} listens on {args.port}"
        found.add(selected[0])
    assert found == set(stages), f"stage workloads the router never finds: {set(stages) - found}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_port_reaches_a_declared_container_port(rendered, overlay):
    check_service_ports(rendered[overlay], overlay)


def check_service_ports(objects: list[dict[str, Any]], overlay: str) -> None:
    pods = {w: (spec, labels) for w, spec, labels in workloads(objects)}
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = {"matchLabels": service["spec"]["selector"]}
        selected = [w for w, (_, labels) in pods.items() if selects(selector, labels)]
        assert len(selected) == 1, f"{name(service)} selects {selected}"
        spec, _ = pods[selected[0]]
        declared = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert declared.get(port["targetPort"]) == port["port"], f"{name(service)} port {port}: {declared}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_is_on_a_command_line(rendered, overlay):
    check_no_secret_in_argv(rendered[overlay], overlay)


def check_no_secret_in_argv(objects: list[dict[str, Any]], overlay: str) -> None:
    values = set(secret_values(objects).values())
    if overlay == "cpu-demo":
        assert len(values) == 2  # the demo's Secret: the negative control of the literal check below
    for workload, spec, _ in workloads(objects):
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            line = [*container.get("command", []), *container.get("args", [])]
            leaked = {ref for arg in line for ref in references(arg)} & secret_vars(container)
            assert not leaked, f"{workload} {container['name']}: $({leaked.pop()}) would put a secret in argv"
            assert not [v for v in values for arg in line if v in arg], f"{workload}: a Secret's value in args"
            assert not set(line) & set(SECRET_FLAGS), f"{workload}: give secrets by env or the -file flags"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_reach_the_roles_that_need_them(rendered, overlay):
    check_secrets_reach(rendered[overlay], overlay)


def check_secrets_reach(objects: list[dict[str, Any]], overlay: str) -> None:
    for workload, _, args, env in serving(objects):
        needs_token = args.role in ("router", "decode", "pd")
        assert ("EPD_ADMIN_TOKEN" in env) == needs_token, workload
        needs_cache = overlay != "pd" and args.role in ("router", "encoder", "prefill", "decode")
        assert ("EPD_REDIS_URL" in env) == needs_cache, workload
        if needs_cache:
            assert env["EPD_REDIS_URL"] == f"redis://:{env['REDIS_PASSWORD']}@epd-redis:6379/0", workload


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_reference_is_defined_before_use(rendered, overlay):
    """Kubernetes leaves ``$(UNKNOWN)`` as written: a typo would reach the process as text."""
    check_references(rendered[overlay], overlay)


def check_references(objects: list[dict[str, Any]], overlay: str) -> None:
    for workload, spec, _ in workloads(objects):
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            defined: list[str] = []
            for var in container.get("env", []):
                missing = set(references(var.get("value", ""))) - set(defined)
                assert not missing, f"{workload} env {var['name']}: {missing} is not defined before it"
                defined.append(var["name"])
            missing = {ref for arg in container.get("args", []) for ref in references(arg)} - set(defined)
            assert not missing, f"{workload} {container['name']} args: {missing} undefined"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_sigterm_drain_fits_the_grace_period(rendered, overlay):
    check_drain(rendered[overlay], overlay)


def check_drain(objects: list[dict[str, Any]], overlay: str) -> None:
    pods = {w: spec for w, spec, _ in workloads(objects)}
    for workload, container, args, _ in serving(objects):
        sleep = container["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep" and int(sleep[1]) >= 3, f"{workload}: preStop {sleep}"
        grace = pods[workload]["terminationGracePeriodSeconds"]
        assert int(sleep[1]) + args.shutdown_grace_s + DRAIN_MARGIN_S <= grace, (
            f"{workload}: preStop {sleep[1]} s + --shutdown-grace-s {args.shutdown_grace_s} + {DRAIN_MARGIN_S} s > "
            f"terminationGracePeriodSeconds {grace}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_stage_and_the_router_has_a_pdb_selecting_its_pods_alone(rendered, overlay):
    check_pdbs(rendered[overlay], overlay)


def check_pdbs(objects: list[dict[str, Any]], overlay: str) -> None:
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    deployments = [(w, labels) for w, _, labels in workloads(objects) if w.startswith("Deployment/")]
    covered = []
    for pdb in pdbs:
        selected = [w for w, labels in deployments if selects(pdb["spec"]["selector"], labels)]
        assert len(selected) == 1, f"{name(pdb)} selects {selected}"
        assert pdb["spec"]["maxUnavailable"] == 1
        covered.append(selected[0])
    assert sorted(covered) == sorted(w for w, _ in deployments)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prefills_and_decodes_spread_over_nodes(rendered, overlay):
    check_spread(rendered[overlay], overlay)


def check_spread(objects: list[dict[str, Any]], overlay: str) -> None:
    for workload, spec, labels in workloads(objects):
        if labels["app.kubernetes.io/component"] not in STAGE_ROLES:
            continue
        (spread,) = spec["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1, workload
        assert spread["labelSelector"]["matchLabels"] == labels, workload


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_on_encode_prefill_and_decode_in_the_gpu_overlays_cpu_and_memory_everywhere(rendered, overlay):
    check_resources(rendered[overlay], overlay)


def check_resources(objects: list[dict[str, Any]], overlay: str) -> None:
    gpu = {a.role: (c["resources"]["limits"].get("nvidia.com/gpu"), getattr(a, "device", None))
           for _, c, a, _ in serving(objects)}
    stage = ("1", "cuda") if overlay in GPU_OVERLAYS else (None, "auto")
    assert gpu == {**{role: stage for role in gpu if role != "router"}, "router": (None, None)}
    for workload, spec, _ in workloads(objects):
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            requests = container["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), f"{workload} {container['name']}: requests {requests}"
            assert "memory" in container["resources"]["limits"], f"{workload} {container['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_our_pods_run_as_the_images_non_root_user(rendered, overlay):
    uid = int(re.search(r"useradd [^\n]*--uid (\d+)", CONTAINERFILE.read_text()).group(1))
    for workload, spec, _ in workloads(rendered[overlay]):
        if ours(spec):
            security = spec["securityContext"]
            assert (security["runAsNonRoot"], security["runAsUser"]) == (True, uid), workload


def test_cpu_demo_generates_its_model_in_an_init_container(rendered):
    objects = rendered["cpu-demo"]
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    pods = {w: spec for w, spec, _ in workloads(objects)}
    for workload, container, args, _ in serving(objects):
        if args.role == "router":
            continue
        spec = pods[workload]
        (init,) = spec["initContainers"]
        made = parse(init["args"])
        assert (made.command, made.family, made.size) == ("make-model", "qwen2_vl", "tiny")
        mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert args.model == f"{mount['models']}/{made.out.rsplit('/', 1)[-1]}" and made.out == args.model, workload
        (volume,) = spec["volumes"]
        assert volume["name"] == "models" and "emptyDir" in volume, workload


def test_an_external_redis_replaces_the_statefulset_and_comes_whole_from_the_secret(tmp_path):
    objects = compose(tmp_path, ["epd", "external-redis", "gpu"])
    for check in (check_schema, check_references, check_no_secret_in_argv, check_ports, check_discovery):
        check(objects, "epd")
    assert not [name(o) for o in objects if o["metadata"]["name"] == "epd-redis"]
    from_secret = {"name": "EPD_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "epd-secrets", "key": "redis-url"}}}
    for workload, container, args, env in serving(objects):
        assert from_secret in container["env"], workload
        assert "REDIS_PASSWORD" not in env, f"{workload}: the in-cluster Redis's password is not needed"


def test_the_servicemonitor_overlay_scrapes_every_stage_and_the_router():
    objects = render("servicemonitor")
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]  # no schema: checked here, not strictly
    check_schema([o for o in objects if o is not monitor], "servicemonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    scraped = sorted(o["metadata"]["name"] for o in objects if o["kind"] == "Service"
                     and selects(monitor["spec"]["selector"], o["metadata"]["labels"])
                     and endpoint["port"] in {port["name"] for port in o["spec"]["ports"]})
    assert scraped == ["epd-decode", "epd-encoder", "epd-prefill", "epd-router"]
    assert endpoint["path"] == "/metrics"
    scrape = load_yaml(PROMETHEUS / "scrape-kubernetes.yml")["scrape_configs"][0]["relabel_configs"]
    (role,) = [r["source_labels"] for r in scrape if r.get("target_label") == "role"]
    assert [r["sourceLabels"] for r in endpoint["relabelings"] if r["targetLabel"] == "role"] == [role]


def _pod(objects: list[dict[str, Any]], workload: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if name(o) == workload]
    return obj["spec"]["template"]["spec"]


def _args(objects: list[dict[str, Any]], workload: str) -> list[str]:
    return _pod(objects, workload)["containers"][0]["args"]


def _env(objects: list[dict[str, Any]], workload: str, var: str) -> dict[str, Any]:
    (entry,) = [e for e in _pod(objects, workload)["containers"][0]["env"] if e["name"] == var]
    return entry


BREAKAGES = {  # a manifest mistake -> (the check that must catch it, what its failure says)
    "a field Kubernetes does not know": (
        lambda o: _pod(o, "Deployment/epd-decode")["containers"][0].update(argz=[]), check_schema, "argz"),
    "a flag stage does not have": (
        lambda o: _args(o, "Deployment/epd-prefill").append("--no-such-flag"), check_ports,
        "unrecognized arguments: --no-such-flag"),
    "a value stage refuses": (
        lambda o: _args(o, "Deployment/epd-decode").extend(["--kv-cache-mib", "0"]), check_ports,
        "--kv-cache-mib must be"),
    "a containerPort the process does not listen on": (
        lambda o: _pod(o, "Deployment/epd-decode")["containers"][0]["ports"][0].update(containerPort=8201),
        check_ports, "listens on {'http': 8200}"),
    "a discovery port off the stage's": (
        lambda o: _args(o, "Deployment/epd-router").__setitem__(
            _args(o, "Deployment/epd-router").index("decode=dns://epd-decode:8200"), "decode=dns://epd-decode:8201"),
        check_discovery, "listens on 8200"),
    "the admin token in args": (
        lambda o: _args(o, "Deployment/epd-router").extend(["--admin-token", "$(EPD_ADMIN_TOKEN)"]),
        check_no_secret_in_argv, "would put a secret in argv"),
    "a Secret's value in args": (
        lambda o: _args(o, "Deployment/epd-encoder").extend(["--redis-url",
                                                             "redis://:cpu-demo-redis-password-not-a-secret@x:1/0"]),
        check_no_secret_in_argv, "a Secret's value in args"),
    "a misspelt variable": (
        lambda o: _env(o, "Deployment/epd-prefill", "EPD_REDIS_URL").update(value="redis://:$(REDIS_PASSWD)@r:6379/0"),
        check_references, "REDIS_PASSWD"),
    "a grace period shorter than the drain": (
        lambda o: _pod(o, "Deployment/epd-decode").update(terminationGracePeriodSeconds=30), check_drain,
        "terminationGracePeriodSeconds 30"),
    "a PDB selecting no pod": (
        lambda o: next(x for x in o if name(x) == "PodDisruptionBudget/epd-decode")["spec"]["selector"]["matchLabels"]
        .update({"app.kubernetes.io/component": "decoder"}), check_pdbs, "selects []"),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_checks_catch_a_broken_manifest(rendered, breakage):
    """Negative controls: each check fails on the cpu-demo overlay with one mistake put in."""
    objects = copy.deepcopy(rendered["cpu-demo"])
    breaks, check, message = BREAKAGES[breakage]
    check(objects, "cpu-demo")  # passes as shipped
    breaks(objects)
    with pytest.raises((AssertionError, pytest.fail.Exception)) as failed:
        check(objects, "cpu-demo")
    assert message in str(failed.value)
