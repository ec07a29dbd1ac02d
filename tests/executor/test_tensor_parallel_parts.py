"""Tensor parallelism's pieces, without processes: which heads and rows each rank holds,
and weights of every format cut to rows and columns (pagoda/executor/parallel/)."""

from __future__ import annotations

import gguf
import pytest
import torch

from pagoda.executor.layers.linear import Linear
from pagoda.executor.layers.packed_linear import PackedLinear
from pagoda.executor.layers.quantization import QuantizedLinear
from pagoda.executor.parallel.partition import aligned_runs, even_runs, head_shares
from pagoda.executor.parallel.slicing import linear_columns, linear_rows
from tests.executor.test_gguf_packed import TYPES, case

Q = gguf.GGMLQuantizationType


def test_heads_split_by_kv_head_even_and_uneven() -> None:
    # SmolLM2-135M: 9 query heads over 3 KV heads, TP=2 -> KV heads 0-1 | 2
    shares = head_shares(9, 3, 2)
    assert [(s.q_start, s.q_stop, s.kv_start, s.kv_stop) for s in shares] == [
        (0, 6, 0, 2), (6, 9, 2, 3)]
    shares = head_shares(32, 8, 4)
    assert [s.num_heads for s in shares] == [8] * 4 and [s.num_kv_heads for s in shares] == [2] * 4
    # every query head is held once, with the KV head it attends to
    for num_heads, num_kv, world in [(9, 3, 2), (32, 8, 4), (4, 2, 2), (8, 1, 4), (12, 2, 4)]:
        shares, group = head_shares(num_heads, num_kv, world), num_heads // num_kv
        held = [h for s in shares for h in range(s.q_start, s.q_stop)]
        assert held == list(range(num_heads))
        for s in shares:
            assert all(s.kv_start <= h // group < s.kv_stop for h in range(s.q_start, s.q_stop))


def test_fewer_kv_heads_than_ranks_replicate_them() -> None:
    shares = head_shares(8, 2, 4)  # each KV head on two ranks, its 4 query heads split 2 + 2
    assert [(s.q_start, s.q_stop, s.kv_start) for s in shares] == [
        (0, 2, 0), (2, 4, 0), (4, 6, 1), (6, 8, 1)]
    with pytest.raises(ValueError, match="multiple of 2"):
        head_shares(8, 2, 3)
    with pytest.raises(ValueError, match="divide the 6 query heads"):
        head_shares(6, 1, 4)


def test_runs_are_even_and_aligned() -> None:
    assert even_runs(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert aligned_runs(1536, 2, 256) == [(0, 768), (768, 1536)]
    assert aligned_runs(96, 2, 32) == [(0, 64), (64, 96)]
    with pytest.raises(ValueError, match="multiples of 32"):
        aligned_runs(100, 2, 32)
    with pytest.raises(ValueError, match="cannot be split over 4"):
        even_runs(3, 4)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_packed_weights_cut_to_columns_and_rows(ggml_type) -> None:
    _, packed, reference = case(ggml_type)  # (48, 512)
    block = packed.input_block()
    assert block == (256 if ggml_type in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32)
    left, right = packed.columns(0, 256), packed.columns(256, 512)
    assert torch.equal(left.dequantize(), reference[:, :256])
    assert torch.equal(right.dequantize(), reference[:, 256:])
    x = torch.randn(3, 512)
    whole = PackedLinear([packed])(x)
    halves = (linear_columns(PackedLinear([packed]), 0, 256, keep_bias=True)(x[:, :256])
              + linear_columns(PackedLinear([packed]), 256, 512, keep_bias=False)(x[:, 256:]))
    torch.testing.assert_close(halves, whole, rtol=1e-4, atol=1e-4)
    rows = linear_rows(PackedLinear([packed]), [(32, 48), (0, 16)])
    torch.testing.assert_close(rows(x), torch.cat([whole[:, 32:48], whole[:, :16]], dim=1))
    if block == 256:
        with pytest.raises(ValueError, match="256-input blocks"):
            packed.columns(0, 32)


def test_segments_of_two_formats_cut_across_their_border() -> None:
    q4k = case(Q.Q4_K, n=32)[1]
    q6k = case(Q.Q6_K, n=32, seed=1)[1]
    layer = PackedLinear([q4k, q6k])  # outputs [q4k 0..31 | q6k 32..63]
    cut = linear_rows(layer, [(16, 48)])
    assert cut.formats == ["q4k", "q6k"] and cut.out_features == 32
    x = torch.randn(2, 512)
    torch.testing.assert_close(cut(x), layer(x)[:, 16:48])


def test_float_and_quantized_linears_cut() -> None:
    torch.manual_seed(0)
    linear = Linear(64, 32, bias=True)
    linear.weight.data.normal_()
    linear.bias.data.normal_()
    x = torch.randn(5, 64)
    whole = linear(x)
    parts = [linear_columns(linear, 0, 32, keep_bias=True), linear_columns(linear, 32, 64, False)]
    torch.testing.assert_close(parts[0](x[:, :32]) + parts[1](x[:, 32:]), whole)
    torch.testing.assert_close(linear_rows(linear, [(8, 16), (24, 32)])(x),
                               torch.cat([whole[:, 8:16], whole[:, 24:32]], dim=1))
    quantized = QuantizedLinear(linear.weight.data, linear.bias.data, "int8",
                                dense_from_rows=None)
    if quantized.kernel == "pagoda":  # its codes become one packed segment
        cut = linear_columns(quantized, 32, 64, keep_bias=False)
        assert isinstance(cut, PackedLinear) and cut.formats == ["q8"]
        torch.testing.assert_close(
            linear_columns(quantized, 0, 32, True)(x[:, :32]) + cut(x[:, 32:]), quantized(x),
            rtol=1e-4, atol=1e-4)


def test_a_start_up_that_lost_its_rendezvous_port_is_tried_again(caplog) -> None:
    from pagoda.executor.parallel import tp_runner

    taken = ValueError("tensor-parallel start-up failed: tensor-parallel rank 0: "
                       "DistNetworkError: ... code: -98, name: EADDRINUSE, message: address "
                       "already in use")
    attempts = []

    def start(config):
        attempts.append(config)
        if len(attempts) < tp_runner.RENDEZVOUS_ATTEMPTS:
            raise taken
        return "workers", ["built"]

    assert tp_runner.start_with_a_free_rendezvous(start, "config") == ("workers", ["built"])
    assert attempts == ["config"] * tp_runner.RENDEZVOUS_ATTEMPTS
    assert "rendezvous port was taken" in caplog.text

    def always_taken(config):
        raise taken

    with pytest.raises(ValueError, match="EADDRINUSE"):  # not forever
        tp_runner.start_with_a_free_rendezvous(always_taken, "config")

    def other_failure(config):
        attempts.append(config)
        raise ValueError("tensor-parallel start-up failed: no such model")

    attempts.clear()
    with pytest.raises(ValueError, match="no such model"):  # other errors are not retried
        tp_runner.start_with_a_free_rendezvous(other_failure, "config")
    assert len(attempts) == 1
