"""Pagoda on Ray Serve, on a two-node Ray cluster on this machine (ray.cluster_utils.Cluster:
a head and one added node, two CPUs each; each engine replica reserves one): `pagoda serve
--ray-serve --ray-address ...` deploys a tiny model, then, in order:

- the OpenAI routes answer through Ray Serve's proxy, streaming included, greedy answers
  equal to the offline engine's;
- a burst scales the engines 1 -> 2 and idleness back to 1, every answer greedy-equal;
- each engine replica's own metrics port is in the --metrics-targets-file (both replicas
  at 2, one again at 1), each page its replica's pagoda:* series; the autoscaler ledger's
  series on --ledger-port, its summary logged at exit;
- a replica killed under load costs only streams it was running, then capacity returns;
- a rolling upgrade (another engine setting) under load fails no request;
- a bad upgrade (a model that fails to load) stops, the old version still serving;
- the worker node removed under load: only what ran there fails, service goes on;
- SIGTERM deletes the application and the command exits 0.

One module-wide deployment (starting Serve and a cluster is the slow part)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import httpx
import pytest

from tests.deploy.serve_load import (
    MAX_TOKENS,
    PROMPTS,
    Load,
    engine_replica_actor,
    running_replicas,
    stream_one,
    wait_until,
)
from tests.entrypoints.server_helpers import RemoteServer
from tests.helpers.ports import free_port

ray = pytest.importorskip("ray", reason="make test installs Ray (the [ray] extra)")
pytest.importorskip("ray.serve", reason="make test installs Ray Serve (ray[serve])")
pytestmark = pytest.mark.slow

FAST_AUTOSCALING_ENV = {
    # Serve's load reports, every 10 s by default: fast enough for a test's burst
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    # a version stops after this many failed replica starts per target replica (default 3:
    # 6 starts of a bad upgrade to 2 replicas, each a Python process importing torch)
    "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1",
}
SERVE_FLAGS = [
    "--served-model-name", "tiny", "--ray-serve", "--proxy-location", "HeadOnly",
    "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "2",
    "--max-ongoing-requests", "6", "--upscale-delay", "0", "--downscale-delay", "4",
    "--autoscale-look-back", "2", "--replica-cpus", "1", "--health-check-period", "1",
    "--shutdown-timeout", "20", "--assign-timeout", "20", "--kv-cache-memory",
    str(64 * 1024 * 1024), "--max-model-len", "512",
]


class Deployment:
    def __init__(self, server: RemoteServer, cluster, folder: str, flags: list[str],
                 targets_file: str = "", ledger_port: int = 0) -> None:
        self.server, self.cluster, self.folder, self.flags = server, cluster, folder, flags
        self.url = server.url
        self.targets_file, self.ledger_port = targets_file, ledger_port

    def redeploy(self, extra: list[str]) -> None:
        """A deployment update of the app with these flags added (a rolling upgrade)."""
        from ray import serve

        from pagoda.deploy.app import parse_serve_args
        from pagoda.deploy.application import application
        from pagoda.entrypoints.openai.api_server import build_server_state

        args = parse_serve_args([*self.flags, "--port", str(self.server.port), *extra])
        serve.run(application(args, build_server_state), name="pagoda", route_prefix="/",
                  blocking=False)


@pytest.fixture(scope="module")
def offline_texts(tiny_folder) -> dict[str, str]:
    from pagoda import LLM, SamplingParams

    llm = LLM(tiny_folder, dtype="float32", max_model_len=512)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                   ignore_eos=True), use_tqdm=False)
    texts = {p: o.outputs[0].text for p, o in zip(PROMPTS, outputs)}
    llm.engine.shutdown()
    return texts


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    from tests.executor.tiny_checkpoints import build_checkpoint_with_bundled_tokenizer

    return build_checkpoint_with_bundled_tokenizer(str(tmp_path_factory.mktemp("tiny")), "qwen3")


@pytest.fixture(scope="module")
def deployment(tiny_folder, offline_texts, tmp_path_factory):
    from ray.cluster_utils import Cluster

    from tests.ray_cluster import wait_for_free_cpus

    saved = {k: os.environ.get(k) for k in FAST_AUTOSCALING_ENV}
    os.environ.update(FAST_AUTOSCALING_ENV)  # the cluster's processes inherit it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    flags = ["--model", tiny_folder, *SERVE_FLAGS]
    server = None
    targets_file = str(tmp_path_factory.mktemp("prometheus") / "pagoda_targets.json")
    ledger_port = free_port()
    try:
        server = RemoteServer([*flags, "--ray-address", cluster.address,
                               "--metrics-targets-file", targets_file,
                               "--ledger-port", str(ledger_port)], startup_timeout=300)
        ray.init(address=cluster.address)
        # the driver's monitors start once serve.run returned, maybe after the proxy answered
        wait_until(lambda: os.path.exists(targets_file), 60, "the targets file written")
        yield Deployment(server, cluster, tiny_folder, flags, targets_file, ledger_port)
        assert server.stop(timeout=120) == 0, server.log_text()[-3000:]
        with open(targets_file) as f:
            assert json.load(f) == []  # the app is gone: no targets left
        assert "autoscaler ledger: {" in server.log_text()
        # the app was deleted: its replicas' CPUs are free again
        assert wait_for_free_cpus(ray, ray.cluster_resources()["CPU"], 60) == \
            ray.cluster_resources()["CPU"]
    finally:
        if server is not None and server.proc.poll() is None:
            server.stop()
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def assert_greedy(outcomes, offline_texts) -> None:
    for o in outcomes:
        if o.error is None:
            assert o.text == offline_texts[o.prompt], o


def test_openai_routes_and_streaming_through_ray_serve(deployment, offline_texts) -> None:
    url = deployment.url
    prompt = PROMPTS[0]
    response = httpx.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == offline_texts[prompt]
    assert response.headers["x-pagoda-replica"]
    streamed = asyncio.run(_stream(url, prompt))
    assert streamed.error is None and streamed.text == offline_texts[prompt]
    chat = httpx.post(url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "stream": True}, timeout=60)
    assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]")
    assert chat.headers["content-type"].startswith("text/event-stream")
    models = httpx.get(url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert "pagoda:" in httpx.get(url + "/metrics", timeout=30).text
    bad = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": 3},
                     timeout=30)
    assert bad.status_code == 400 and "error" in bad.json()  # the app's own 400, unchanged


async def _stream(url: str, prompt: str):
    async with httpx.AsyncClient(timeout=60) as client:
        return await stream_one(client, url, prompt)


def test_autoscales_up_under_a_burst_and_down_when_idle(deployment, offline_texts) -> None:
    assert running_replicas() == 1
    with Load(deployment.url, concurrency=8) as load:
        wait_until(lambda: running_replicas() == 2, 120, "scaled up to 2 replicas")
        load.wait_for(len(load.outcomes) + 16)  # some answers from the two
        outcomes = load.stop()
    assert [o for o in outcomes if o.error is not None] == []
    assert_greedy(outcomes, offline_texts)
    assert len({o.replica for o in outcomes}) >= 2  # the new replica served too
    wait_until(lambda: running_replicas() == 1, 120, "scaled back down to 1 replica")


def metrics_targets(deployment) -> dict[str, str]:
    """{serve_replica: "ip:port"} of the targets file."""
    with open(deployment.targets_file) as f:
        return {g["labels"]["serve_replica"]: g["targets"][0] for g in json.load(f)}


def sample(page: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` (with these labels) on a metrics page, without a
    data-parallel `replica` label (the totals the alert rules read)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for family in text_string_to_metric_families(page)
               for s in family.samples if s.name == name and not s.labels.get("replica")
               and labels.items() <= s.labels.items())


def ledger_replicas(deployment) -> float:
    page = httpx.get(f"http://127.0.0.1:{deployment.ledger_port}/metrics", timeout=30).text
    return sample(page, "pagoda:serve_replicas", deployment="PagodaEngine")


def test_every_replica_is_scraped_on_its_own_from_the_targets_file(deployment) -> None:
    wait_until(lambda: len(metrics_targets(deployment)) == 1, 30, "the targets file lists 1")
    with Load(deployment.url, concurrency=8) as load:
        wait_until(lambda: running_replicas() == 2, 120, "scaled up to 2 replicas")
        wait_until(lambda: len(metrics_targets(deployment)) == 2, 30,
                   "the targets file lists both replicas")
        targets = metrics_targets(deployment)
        wait_until(lambda: len({o.replica for o in load.outcomes if o.error is None}) == 2,
                   60, "answers from both replicas")
        wait_until(lambda: ledger_replicas(deployment) == 2, 30, "the ledger counts 2")
        outcomes = load.stop()
    served = {o.replica for o in outcomes if o.error is None}
    assert served <= set(targets), (served, targets)  # labelled with Serve's replica id
    pages = {rid: httpx.get(f"http://{address}/metrics", timeout=30).text
             for rid, address in targets.items()}
    for rid, page in pages.items():
        assert 'pagoda:prompt_tokens_total{model_name="tiny"}' in page, rid
        answered = sum(1 for o in outcomes if o.replica == rid and o.error is None)
        assert sample(page, "pagoda:request_success_total") >= answered > 0, rid
    wait_until(lambda: running_replicas() == 1, 120, "scaled back down to 1 replica")
    wait_until(lambda: len(metrics_targets(deployment)) == 1, 30, "the targets file lists 1")
    (gone,) = set(targets) - set(metrics_targets(deployment))
    with pytest.raises(httpx.HTTPError):  # the removed replica's port closed with it
        httpx.get(f"http://{targets[gone]}/metrics", timeout=5)


def test_a_replica_killed_under_load_costs_only_its_streams(deployment, offline_texts) -> None:
    with Load(deployment.url, concurrency=8) as load:
        wait_until(lambda: running_replicas() == 2, 120, "2 replicas under load")
        wait_until(lambda: len(set(load.open_streams.values())) == 2, 60,
                   "streams open on both replicas")
        victim = next(iter(load.open_streams.values()))
        before = len(load.outcomes)
        victim_open = list(load.open_streams.values()).count(victim)
        ray.kill(engine_replica_actor(victim), no_restart=True)
        wait_until(lambda: running_replicas() == 2, 60, "capacity back within 60 s")
        load.wait_for(before + 24)
        outcomes = load.stop()
    failed = [o for o in outcomes if o.error is not None]
    assert all(o.replica in (victim, None) for o in failed), failed
    # only its streams (a few more may have started in the moment before the kill landed):
    # requests it had accepted but not yet answered went on to the living replica
    assert len(failed) <= victim_open + 2, (failed, victim_open)
    for o in failed:
        assert o.error in ("replica_died", "http 503"), o
        if o.status == 503:
            assert o.retry_after
    assert [o for o in outcomes[before + len(failed) + 8:] if o.error] == []
    assert_greedy(outcomes, offline_texts)


def test_rolling_upgrade_under_load_fails_no_request(deployment, offline_texts) -> None:
    with Load(deployment.url, concurrency=4) as load:
        load.wait_for(4)
        old = {o.replica for o in load.outcomes}
        deployment.redeploy(["--kv-cache-memory", str(48 * 1024 * 1024)])  # a new setting
        start = len(load.outcomes)
        load.wait_for(start + 8)
        outcomes = load.stop()
    assert [o for o in outcomes if o.error is not None] == []
    assert_greedy(outcomes, offline_texts)
    assert not {o.replica for o in outcomes[start + 4:]} & old  # all on the new version


def test_a_bad_upgrade_stops_and_the_old_version_keeps_serving(deployment, tmp_path,
                                                               offline_texts) -> None:
    """Ray Serve replaces replicas stop-then-start, one at a time: a version whose replicas
    fail to start stops the rollout after some failures (its retry count per replica, here
    1, times the replicas), and the old replicas not yet replaced
    keep serving. So at least 2 replicas (here --min-replicas 2) for an upgrade that may
    fail: with one, its replacement failing leaves none (the README says so)."""
    two = ["--kv-cache-memory", str(48 * 1024 * 1024), "--min-replicas", "2"]
    deployment.redeploy(two)
    wait_until(lambda: running_replicas() == 2, 120, "2 replicas of the good version")
    bad = shutil.copytree(deployment.folder, tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with Load(deployment.url, concurrency=2) as load:
        load.wait_for(2)
        with pytest.raises(RuntimeError, match="(?i)fail"):
            Deployment(deployment.server, deployment.cluster, str(bad),
                       ["--model", str(bad), *SERVE_FLAGS]).redeploy(two)
        start = len(load.outcomes)
        load.wait_for(start + 6)
        outcomes = load.stop()
    assert running_replicas() >= 1  # an old one, still up
    assert [o for o in outcomes if o.error is not None] == []
    assert_greedy(outcomes, offline_texts)
    deployment.redeploy(["--kv-cache-memory", str(48 * 1024 * 1024)])  # healthy again
    wait_until(lambda: running_replicas() >= 1, 120, "the good version back")


def test_the_worker_node_removed_under_load(deployment, offline_texts) -> None:
    with Load(deployment.url, concurrency=8) as load:
        wait_until(lambda: running_replicas() == 2, 120, "2 replicas under load")
        wait_until(lambda: len(set(load.open_streams.values())) == 2, 60,
                   "streams open on both replicas")
        worker = deployment.cluster.list_all_nodes()[1]
        before = len(load.outcomes)
        deployment.cluster.remove_node(worker)
        wait_until(lambda: running_replicas() == 2, 90, "capacity back on the head node")
        load.wait_for(before + 24)
        outcomes = load.stop()
    failed = [o for o in outcomes if o.error is not None]
    assert len(failed) <= 6 + 8, failed  # its replica's streams, and its ingress's
    assert len(failed) < len(outcomes) - before
    assert [o for o in outcomes[-8:] if o.error] == []  # service goes on
    assert_greedy(outcomes, offline_texts)
