"""Tensor and data parallelism for Llama-2-7B and -70B on H100/H200-class GPUs over NVLink,
PCIe and Ethernet, modelled on paper: it measures nothing. Inputs are vendor spec-sheet
figures (GPUS, LINKS, MODELS below); the formulas are in ``modelled_step``. It prints the
tables of BENCHMARKS.md's distributed-inference section, whose measured half (what an
all-reduce costs on this machine) is benchmarks/allreduce_cost.py.

    python benchmarks/parallel_model.py
"""

from __future__ import annotations

# Vendor spec sheet figures: (memory bytes, HBM bytes/s, dense bf16 FLOP/s).
GPUS = {"H100 SXM 80GB": (80e9, 3.35e12, 989e12), "H200 141GB": (141e9, 4.8e12, 989e12)}
# (bytes/s per direction per GPU, latency alpha of one all-reduce in seconds).
LINKS = {"NVLink 4": (450e9, 5e-6), "PCIe Gen5 x16": (64e9, 10e-6),
         "400 GbE RDMA": (50e9, 25e-6), "100 GbE RDMA": (12.5e9, 25e-6),
         "100 GbE TCP": (12.5e9, 100e-6)}
# layers, hidden, parameters, bf16 weight bytes, KV cache bytes per token (2 x layers x
# kv_heads x head_dim x 2 bytes).
MODELS = {"Llama-2-7B": {"layers": 32, "hidden": 4096, "params": 6.74e9, "weight_bytes": 13.5e9,
                         "kv_bytes_per_token": 2 * 32 * 32 * 128 * 2},
          "Llama-2-70B": {"layers": 80, "hidden": 8192, "params": 69e9, "weight_bytes": 140e9,
                          "kv_bytes_per_token": 2 * 80 * 8 * 128 * 2}}
BF16_BYTES = 2
MODEL_CONTEXT = 1024  # tokens of context per sequence during decode (KV read per step)
MODEL_PREFILL = 2048  # prompt tokens of one prefill


def modelled_allreduce_s(num_bytes: float, num_gpus: int, link: str) -> float:
    """alpha + 2 (N - 1) / N x bytes / beta: one collective's latency plus a ring's traffic."""
    if num_gpus == 1:
        return 0.0
    bandwidth, alpha = LINKS[link]
    return alpha + 2 * (num_gpus - 1) / num_gpus * num_bytes / bandwidth


def modelled_step(model: str, gpu: str, link: str, num_gpus: int, batch: int,
                  prefill_tokens: int = 0) -> dict:
    """One forward at TP=N, in seconds: max(memory, compute) + 2 all-reduces per layer.

    decode (prefill_tokens 0): batch sequences, one token each, MODEL_CONTEXT tokens of context:
        bytes = weights + batch x context x kv_bytes_per_token
        flops = 2 x params x batch + 4 x layers x hidden x context x batch   (matmuls + attention)
    prefill: one sequence of prefill_tokens:
        bytes = weights
        flops = 2 x params x S + 2 x layers x hidden x S^2                 (causal attention)
    time = max(bytes / (N x HBM), flops / (N x peak))
           + layers x 2 x allreduce(tokens x hidden x 2 bytes)
    """
    spec = MODELS[model]
    _, hbm, peak = GPUS[gpu]
    if prefill_tokens:
        tokens = prefill_tokens
        num_bytes = spec["weight_bytes"]
        flops = (2 * spec["params"] * tokens
                 + 2 * spec["layers"] * spec["hidden"] * tokens ** 2)
    else:
        tokens = batch
        num_bytes = spec["weight_bytes"] + batch * MODEL_CONTEXT * spec["kv_bytes_per_token"]
        flops = (2 * spec["params"] * batch
                 + 4 * spec["layers"] * spec["hidden"] * MODEL_CONTEXT * batch)
    memory_s = num_bytes / (num_gpus * hbm)
    compute_s = flops / (num_gpus * peak)
    comm_s = spec["layers"] * 2 * modelled_allreduce_s(tokens * spec["hidden"] * BF16_BYTES,
                                                       num_gpus, link)
    return {"memory_s": memory_s, "compute_s": compute_s, "comm_s": comm_s,
            "total_s": max(memory_s, compute_s) + comm_s}


def modelled_gb_per_gpu(model: str, num_gpus: int, batch: int) -> float:
    spec = MODELS[model]
    num_bytes = spec["weight_bytes"] + batch * MODEL_CONTEXT * spec["kv_bytes_per_token"]
    return num_bytes / num_gpus / 1e9


def format_model() -> str:
    lines = []
    for model, gpu, sizes, baseline in (("Llama-2-7B", "H100 SXM 80GB", (1, 2, 4, 8), 1),
                                        ("Llama-2-70B", "H200 141GB", (2, 4, 8), 2)):
        capacity = GPUS[gpu][0] / 1e9
        lines += ["", (f"{model} on {gpu} (modelled), context {MODEL_CONTEXT} during decode, "
                      f"speed-up against TP={baseline} over NVLink 4"),
                  (f"{'interconnect':<14} {'TP':>3} {'GB/GPU@64':>9} {'dec b1 ms':>9} {'x':>5} "
                  f"{'comm%':>5} {'dec b64 ms':>10} {'x':>5} {'comm%':>5} {'tok/s b64':>9} "
                  f"{'prefill ms':>10} {'x':>5} {'comm%':>5}")]
        base = {name: modelled_step(model, gpu, "NVLink 4", baseline, batch, prefill)["total_s"]
                for name, batch, prefill in (("b1", 1, 0), ("b64", 64, 0),
                                             ("prefill", 1, MODEL_PREFILL))}
        for link in LINKS:
            for num_gpus in sizes:
                if num_gpus == 1 and link != "NVLink 4":
                    continue
                row = f"{link if num_gpus > 1 else '(one GPU)':<14} {num_gpus:>3} "
                gb = modelled_gb_per_gpu(model, num_gpus, 64)
                row += f"{gb:>8.0f}{'!' if gb > capacity else ' '} "
                for name, batch, prefill in (("b1", 1, 0), ("b64", 64, 0),
                                             ("prefill", 1, MODEL_PREFILL)):
                    step = modelled_step(model, gpu, link, num_gpus, batch, prefill)
                    width = 10 if name != "b1" else 9
                    row += (f"{step['total_s'] * 1e3:>{width}.2f} "
                            f"{base[name] / step['total_s']:>5.2f} "
                            f"{step['comm_s'] / step['total_s']:>5.0%} ")
                    if name == "b64":
                        row += f"{64 / step['total_s']:>9.0f} "
                lines.append(row.rstrip())
    lines += ["", (f"8 GPUs, 256 sequences in flight, decode at context {MODEL_CONTEXT} "
                   "(modelled): TP inside a group, DP (whole replicas, no traffic between them) "
                   "across groups"),
              (f"{'model':<12} {'layout':<12} {'TP traffic over':<14} {'seqs/replica':>12} "
              f"{'step ms':>8} {'tok/s':>8} {'GB/GPU':>7}")]
    for model, gpu, layouts in (
            ("Llama-2-7B", "H100 SXM 80GB", ((1, "none"), (2, "NVLink 4"), (8, "NVLink 4"),
                                              (8, "400 GbE RDMA"), (8, "100 GbE RDMA"))),
            ("Llama-2-70B", "H200 141GB", ((2, "NVLink 4"), (4, "NVLink 4"), (8, "NVLink 4"),
                                            (8, "400 GbE RDMA"), (8, "100 GbE RDMA")))):
        for tp, link in layouts:
            replicas = 8 // tp
            batch = 256 // replicas
            step = modelled_step(model, gpu, link if tp > 1 else "NVLink 4", tp, batch)
            lines.append(f"{model:<12} {f'TP={tp} x DP={replicas}':<12} {link:<14} {batch:>12} "
                         f"{step['total_s'] * 1e3:>8.2f} {256 / step['total_s']:>8.0f} "
                         f"{modelled_gb_per_gpu(model, tp, batch):>7.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    print(format_model())


if __name__ == "__main__":
    main()
