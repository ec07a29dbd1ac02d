"""`bench throughput` / `bench latency` on the shared bundled engine, and `bench compare`."""

from __future__ import annotations

import json

import pytest

from pagoda.bench import offline, report
from pagoda.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_throughput_runs_the_fixed_workload(bundled_llm):
    summary = offline.run_throughput(bundled_llm, num_prompts=4, input_len=12, output_len=6,
                                     seed=0)
    assert summary["num_requests"] == 4
    assert summary["num_prompt_tokens"] == 48
    assert summary["num_output_tokens"] == 24  # ignore_eos: every request runs to max_tokens
    assert summary["output_tokens_per_s"] == pytest.approx(24 / summary["elapsed_s"])
    assert summary["total_tokens_per_s"] == pytest.approx(72 / summary["elapsed_s"])
    # the four requests ran together: 4 per step, 6 steps (one prefill + five decodes)
    assert summary["batch_sizes"] == {"4": 6}
    assert summary["num_steps"] == 6 and summary["mean_batch_size"] == 4.0
    # the workload is fixed by the seed (the transformers baseline rebuilds it)
    tokenizer = bundled_llm.get_tokenizer()
    assert offline.random_prompts(tokenizer, 4, 12, 0.0, 0) == \
        offline.random_prompts(tokenizer, 4, 12, 0.0, 0)


@pytest.mark.slow
def test_latency_measures_prefill_and_decode(bundled_llm):
    summary, iterations = offline.run_latency(bundled_llm, input_len=16, output_len=5,
                                              num_iters=2, num_warmup_iters=1)
    assert len(iterations) == 2 and summary["num_iters"] == 2
    for it in iterations:
        assert it["num_output_tokens"] == 5
        assert 0 < it["ttft_s"] < it["e2el_s"] <= it["wall_s"] + 1e-3
        assert it["decode_tokens_per_s"] > 0
    assert summary["prefill_tokens_per_s"] > 0
    with pytest.raises(ValueError, match="output-len"):
        offline.run_latency(bundled_llm, 16, 1, 1)


def serve_result(ttft: float, tpot: float, throughput: float) -> dict:
    requests = [{"index": i, "success": True, "ttft": ttft * (1 + i / 10), "tpot": tpot,
                 "itl": [tpot, tpot], "latency": ttft + 2 * tpot} for i in range(5)]
    stats = {"mean": ttft, "median": ttft, "p90": ttft, "p95": ttft, "p99": ttft}
    tstats = {k: tpot for k in stats}
    summary = {"completed": 5, "failed": 0, "request_throughput": throughput / 10,
               "output_throughput": throughput, "total_token_throughput": throughput * 2,
               "ttft_s": stats, "tpot_s": tstats, "itl_s": tstats, "e2el_s": stats}
    result = report.envelope("serve", "server", {"model": "m", "base_url": "u"})
    result["runs"] = [{"request_rate": "inf", "max_concurrency": c, "summary": summary,
                       "requests": requests} for c in (1, 4)]
    return result


def test_compare_table_and_plot(tmp_path, capsys):
    base = report.envelope("throughput", "transformers", {})
    base["summary"] = offline.throughput_summary(8, 800, 800, 10.0, {8: 100}, 100)
    ours = report.envelope("throughput", "pagoda", {})
    ours["label"] = "pagoda"
    ours["summary"] = offline.throughput_summary(8, 800, 800, 5.0, {8: 100}, 100)
    paths = []
    for name, result in [("hf", base), ("ours", ours), ("peer", serve_result(0.2, 0.05, 100)),
                         ("srv", serve_result(0.1, 0.06, 150))]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(result))
        paths.append(str(path))
    png = tmp_path / "cmp.png"
    assert main(["bench", "compare", *paths, "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    # offline results first, then the sweeps side by side, point by point
    assert header == ["metric", "hf", "pagoda", "peer conc=1", "srv conc=1", "peer conc=4",
                      "srv conc=4"]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in table.splitlines()[2:] if line.startswith("|")}
    # offline: ratio to the first column; 800 tokens in 5 s over 800 in 10 s
    assert rows["output tokens/s"][:2] == ["80.0", "160.0 (×2.00)"]
    # sweeps: each run against the first file's run of the same concurrency
    assert rows["output tokens/s"][2:] == ["100.0", "150.0 (×1.50)", "100.0", "150.0 (×1.50)"]
    assert rows["TTFT mean ms"][2:4] == ["200.0", "100.0 (×0.50)"]
    assert rows["TPOT mean ms"][2:4] == ["50.00", "60.00 (×1.20)"]
    assert rows["TTFT mean ms"][:2] == ["-", "-"]
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_compare_rejects_other_json(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}')
    assert main(["bench", "compare", str(path)]) == 2
    assert "not a result" in capsys.readouterr().err
