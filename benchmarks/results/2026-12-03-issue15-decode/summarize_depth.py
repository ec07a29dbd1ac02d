"""Ratios of the matched-context rounds (bench_rounds.sh): Pagoda's decode tokens/s over
llama-bench's tg128, after the same context (prompt 1 ~ depth 0, prompt 128 ~ depth 128)."""
import json
import statistics

FILES = {"smollm2-q4_k_m": "Q4_K_M", "SmolLM2-135M-Instruct.Q4_1": "Q4_1 (bundled)"}
rows = {}
for round_ in "abc":
    for entry in json.load(open(f"llama-bench-depth-{round_}.json")):
        name = entry["model_filename"].split("/")[-1].removesuffix(".gguf")
        depth = entry["n_depth"]
        prompt = 1 if depth == 0 else 128
        ours = json.load(open(f"pagoda-latency-{name}-in{prompt}-{round_}.json"))
        decode = ours["summary"]["decode_tokens_per_s"]["mean"]
        rows.setdefault((name, depth), []).append((entry["avg_ts"], decode))
for (name, depth), runs in rows.items():
    ratios = [ours / theirs for theirs, ours in runs]
    print(f"| {FILES[name]} | {depth} | "
          + ", ".join(f"{t:.1f}" for t, _ in runs) + " | "
          + ", ".join(f"{o:.1f}" for _, o in runs) + " | "
          + ", ".join(f"{r:.2f}" for r in ratios) + f" | {statistics.median(ratios):.2f} |")
