"""deploy/kubernetes/: every object against the Kubernetes API's own JSON schemas (offline, the
schemas that ``kubernetes-validate`` ships), then what a schema cannot see: selectors, ports,
probes, names the router resolves, and each container's arguments through our own parsers. Each
check is also run on broken copies, to show that it fails on them."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

import decode_service.__main__ as decode_main
import prefill_service.__main__ as prefill_main
from common.security import TOKEN_FILE_ENV, security_from_args
from router.__main__ import build_parser as router_parser, config_from_args
from router.discovery import parse_target
from router.server import SERVICE_NAME as ROUTER_SERVICE

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
HANDOFF_PORT = 50063  # the decode pods' --handoff-port
# grpc probes are GA from 1.27; the newest schemas the package ships are checked too
VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
WORKERS = {"flashsplit-prefill": (prefill_main, prefill_main.SERVICE_NAME),
           "flashsplit-decode": (decode_main, decode_main.SERVICE_NAME)}
# made with kubectl (docs/kubernetes.md), so that an `apply` never replaces a real secret
EXTERNAL_SECRETS = {"flashsplit-internal-token", "flashsplit-api-key"}
_VAR = re.compile(r"\$\((\w+)\)")


def load() -> list[dict]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def named(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def schema_errors(docs) -> list[str]:
    errors = []
    for doc in docs:
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{doc['kind']}/{doc['metadata']['name']} ({version}): "
                              f"{exc.message}")
    return errors


def container_env(container, config_maps) -> dict[str, str]:
    env = {}
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("configMapKeyRef")
        if ref is not None:
            env[var["name"]] = config_maps[ref["name"]]["data"][ref["key"]]
        elif "value" in var:
            env[var["name"]] = var["value"]
    return env


def parse_args(deployment, container, argv, env, tmp_path) -> str | None:
    """Run the container's arguments through the real parser; a message when they fail."""
    name = deployment["metadata"]["name"]
    token = tmp_path / "internal-token"
    token.write_text("k" * 43)
    environ = {**env, TOKEN_FILE_ENV: str(token)}
    try:
        if name in WORKERS:
            module = WORKERS[name][0]
            parsed = []
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(module, "run_worker", lambda args, serve: parsed.append(args) or 0)
                module.main(argv)
            security_from_args(parsed[0], environ)
        else:
            config_from_args(router_parser().parse_args(argv), environ)
    except (SystemExit, ValueError) as exc:
        return f"{name}: {container['name']}'s arguments {argv} fail: {exc}"
    return None


def problems(docs, tmp_path) -> list[str]:
    """What would make the objects fail together even though each fits its schema."""
    return service_problems(docs) + deployment_problems(docs, tmp_path) + policy_problems(docs)


def service_problems(docs) -> list[str]:
    """Each Service selects one Deployment's pods and a port they serve; workers' are headless."""
    out = []
    deployments = named(docs, "Deployment")
    for name, svc in named(docs, "Service").items():
        selector = svc["spec"]["selector"]
        matches = _pods(deployments, selector)
        if len(matches) != 1:
            out.append(f"Service {name} selects {len(matches)} Deployments")
            continue
        ports = {p["name"]: p["containerPort"] for c in
                 matches[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            if port["targetPort"] not in ports:
                out.append(f"Service {name} targets port {port['targetPort']!r}, not a "
                           f"container port of {matches[0]['metadata']['name']}")
        if name in WORKERS and svc["spec"].get("clusterIP") != "None":
            out.append(f"Service {name} is not headless: DNS would not list every pod")
    return out


def deployment_problems(docs, tmp_path) -> list[str]:
    """Volumes, probes, GPUs, the token file, the arguments and the router's targets."""
    out = []
    deployments, services = named(docs, "Deployment"), named(docs, "Service")
    config_maps, claims = named(docs, "ConfigMap"), named(docs, "PersistentVolumeClaim")
    for name, dep in deployments.items():
        spec = dep["spec"]["template"]["spec"]
        if not _pods({name: dep}, dep["spec"]["selector"]["matchLabels"]):
            out.append(f"Deployment {name}: its selector does not match its pods")
        volumes = {v["name"]: v for v in spec["volumes"]}
        for v in volumes.values():
            if "secret" in v and v["secret"]["secretName"] not in EXTERNAL_SECRETS:
                out.append(f"Deployment {name}: unknown Secret {v['secret']['secretName']}")
            if "persistentVolumeClaim" in v and \
                    v["persistentVolumeClaim"]["claimName"] not in claims:
                out.append(f"Deployment {name}: unknown claim "
                           f"{v['persistentVolumeClaim']['claimName']}")
        for c in spec["containers"]:
            env = container_env(c, config_maps)
            ports = {p["containerPort"] for p in c["ports"]}
            service = WORKERS[name][1] if name in WORKERS else ROUTER_SERVICE
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind, {}).get("grpc")
                if probe is None:
                    out.append(f"{name}: no gRPC {kind}")
                elif probe["port"] not in ports:
                    out.append(f"{name}: {kind} asks port {probe['port']}, not served")
                elif probe.get("service", service) != service:
                    out.append(f"{name}: {kind} asks for {probe['service']}, not {service}")
            gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
            if (name in WORKERS) != (gpus == 1):
                out.append(f"{name}: nvidia.com/gpu limit {gpus}")
            token = env.get(TOKEN_FILE_ENV, "")
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
            if not any(token.startswith(path + "/") and "secret" in v
                       and v["secret"]["secretName"] == "flashsplit-internal-token"
                       for path, v in mounts.items()):
                out.append(f"{name}: ${TOKEN_FILE_ENV} is not in the internal token's Secret")
            argv = [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in c["args"]]
            if any(_VAR.search(a) for a in argv):
                out.append(f"{name}: an argument names a variable the container lacks: {argv}")
            failure = parse_args(dep, c, argv, env, tmp_path)
            if failure:
                out.append(failure)
            grace = float(argv[argv.index("--grace") + 1]) if "--grace" in argv else 5.0
            if spec.get("terminationGracePeriodSeconds", 30) <= grace:
                out.append(f"{name}: killed before its --grace of {grace} s is over")
            for flag in ("--prefill", "--decode"):
                for target in (argv[i + 1] for i, a in enumerate(argv) if a == flag):
                    t = parse_target(target, flag[2:])
                    svc = services.get(t.host)
                    if not t.dns or svc is None or svc["spec"].get("clusterIP") != "None" or \
                            t.port not in {p["port"] for p in svc["spec"]["ports"]}:
                        out.append(f"{name}: {flag} {target} is not a headless Service's port")
    return out


def _pods(deployments, selector):
    return [d for d in deployments.values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]


def policy_problems(docs) -> list[str]:
    """Each NetworkPolicy must select a Deployment's pods, let through a port they serve, and
    admit only callers that exist: a policy matching nothing would silently cut a worker off."""
    out = []
    deployments = named(docs, "Deployment")
    for name, policy in named(docs, "NetworkPolicy").items():
        targets = _pods(deployments, policy["spec"]["podSelector"]["matchLabels"])
        if len(targets) != 1:
            out.append(f"NetworkPolicy {name} selects {len(targets)} Deployments")
            continue
        served = {p["containerPort"] for c in targets[0]["spec"]["template"]["spec"]["containers"]
                  for p in c["ports"]}
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                if port["port"] not in served:
                    out.append(f"NetworkPolicy {name} opens port {port['port']}, not served")
            for peer in rule["from"]:
                if not _pods(deployments, peer["podSelector"]["matchLabels"]):
                    out.append(f"NetworkPolicy {name} admits pods no Deployment runs")
    # the calls the router and the prefill workers make must be let through, on their ports
    admitted = {(n, c, port["port"]) for n, pol in named(docs, "NetworkPolicy").items()
                for rule in pol["spec"]["ingress"] for peer in rule["from"]
                for c in [peer["podSelector"]["matchLabels"].get("app.kubernetes.io/component")]
                for port in rule["ports"]}
    for callee, caller, port in (("flashsplit-prefill", "router", 50061),
                                 ("flashsplit-decode", "router", 50062),
                                 ("flashsplit-decode", "prefill", 50062),
                                 ("flashsplit-decode", "prefill", HANDOFF_PORT)):
        if callee in named(docs, "NetworkPolicy") and (callee, caller, port) not in admitted:
            out.append(f"NetworkPolicy {callee} shuts out the {caller} on port {port}")
    return out


def test_every_manifest_fits_the_kubernetes_schemas():
    docs = load()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap"}
    assert sorted(named(docs, "Deployment")) == ["flashsplit-decode", "flashsplit-prefill",
                                                 "flashsplit-router"]
    assert schema_errors(docs) == []


def test_the_manifests_fit_together_and_their_arguments_parse(tmp_path):
    assert problems(load(), tmp_path) == []


def _container(docs, deployment):
    return named(docs, "Deployment")[deployment]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("mutate, expected", [
    (lambda c: c["livenessProbe"]["grpc"].update(port="grpc"), "'grpc' is not of type"),
    (lambda c: c.update(args="--port 50061"), "is not of type 'array'"),
    (lambda c: c.update(readinessProbe={"grpc": {"port": 50061}, "periodSecond": 5}),
     "periodSecond"),  # strict: an unknown field is an error, not ignored
    (lambda c: c.pop("name"), "name"),
])
def test_the_schema_check_fails_on_broken_copies(mutate, expected):
    docs = copy.deepcopy(load())
    mutate(_container(docs, "flashsplit-prefill"))
    errors = schema_errors(docs)
    assert errors and all(expected in e for e in errors)


@pytest.mark.parametrize("deployment, mutate, expected", [
    ("flashsplit-router", lambda c: c["args"].__setitem__(
        c["args"].index("dns:///flashsplit-decode:50062"), "dns:///flashsplit-decoder:50062"),
     "not a headless Service"),
    ("flashsplit-router", lambda c: c["args"].append("--discovery-every"), "arguments"),
    ("flashsplit-decode", lambda c: c["args"].extend(["--handoff-transport", "pigeon"]),
     "arguments"),
    ("flashsplit-prefill", lambda c: c["readinessProbe"]["grpc"].update(port=50062),
     "not served"),
    ("flashsplit-decode", lambda c: c["startupProbe"]["grpc"].update(
        service="flashsplit.v1.Prefill"), "not flashsplit.v1.Decode"),
    ("flashsplit-decode", lambda c: c["resources"]["limits"].pop("nvidia.com/gpu"),
     "nvidia.com/gpu"),
    ("flashsplit-prefill", lambda c: c["env"].__setitem__(
        -1, {"name": TOKEN_FILE_ENV, "value": "/tmp/token"}), "internal token"),
    ("flashsplit-router", lambda c: c["args"].__setitem__(
        c["args"].index("$(MODEL)"), "$(MODEL_DIR)"), "variable"),
])
def test_the_consistency_checks_fail_on_broken_copies(tmp_path, deployment, mutate, expected):
    docs = copy.deepcopy(load())
    mutate(_container(docs, deployment))
    found = problems(docs, tmp_path)
    assert found and any(expected in p for p in found), found


def test_a_network_policy_that_shuts_out_a_caller_is_caught(tmp_path):
    docs = copy.deepcopy(load())
    policy = named(docs, "NetworkPolicy")["flashsplit-decode"]["spec"]["ingress"][0]
    policy["from"].pop()  # the prefill workers could no longer hand off
    policy["ports"][0]["port"] = 50061
    found = policy_problems(docs)
    assert "NetworkPolicy flashsplit-decode shuts out the prefill on port 50062" in found
    assert "NetworkPolicy flashsplit-decode opens port 50061, not served" in found


def test_a_policy_without_the_handoff_port_is_caught():
    docs = copy.deepcopy(load())
    rules = named(docs, "NetworkPolicy")["flashsplit-decode"]["spec"]["ingress"]
    rules[:] = [r for r in rules if all(p["port"] != HANDOFF_PORT for p in r["ports"])]
    assert f"NetworkPolicy flashsplit-decode shuts out the prefill on port {HANDOFF_PORT}" \
        in policy_problems(docs)


def test_the_decode_worker_listens_for_handoff_chunks_where_its_policy_opens():
    decode = _container(load(), "flashsplit-decode")
    args = decode["args"]
    assert args[args.index("--handoff-transport") + 1] == "tcp"
    assert int(args[args.index("--handoff-port") + 1]) == HANDOFF_PORT
    prefill = _container(load(), "flashsplit-prefill")["args"]
    assert prefill[prefill.index("--handoff-transport") + 1] == "tcp"


def test_a_worker_service_that_is_not_headless_is_caught(tmp_path):
    docs = copy.deepcopy(load())
    named(docs, "Service")["flashsplit-prefill"]["spec"].pop("clusterIP")
    found = problems(docs, tmp_path)
    assert any("not headless" in p for p in found)
    assert any("--prefill dns:///flashsplit-prefill:50061" in p for p in found)
