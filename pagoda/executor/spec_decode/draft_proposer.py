"""A draft model proposes k tokens per request: a smaller model with the target's tokenizer,
run by a ModelRunner of its own (its own paged KV cache, blocks handed out here).

Per request the proposer remembers the tokens whose KV its cache holds (`fed`). Each step:

    real tokens   t0 ... t(T-1)                       (the runner's record; T = num_tokens)
    fed           the longest prefix of `fed` equal to the real tokens survives (proposals
                  the target rejected, and the tokens after them, fall off), never all T:
                  the last real token's logits are needed
    forward 1     the real tokens not yet fed, every request in one forward -> d1
    forward j     d(j-1) at position T + j - 2, one token per request       -> dj (j <= k)

Greedy requests take the draft's argmax (deterministic: the verifier treats them as
one-hot); sampled ones draw from softmax(draft logits / temperature), and those
distributions are kept for the rejection sampler (`draft_probs`). Seeded requests draw
from a generator of their own (seed + DRAFT_SEED_SALT: independent of the verifier's).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.config import CacheConfig, EngineConfig
from pagoda.executor.input_batch import CachedRequestState, InputBatch
from pagoda.executor.loader.model_files import resolve_model_files
from pagoda.executor.loader.model_loader import load_model, open_checkpoint
from pagoda.executor.loader.tokenizer import load_tokenizer
from pagoda.executor.step_sampling import SeededGenerators
from pagoda.sampling_params import SAMPLING_EPS

logger = logging.getLogger(__name__)

DRAFT_SEED_SALT = 0x5EED_D4AF7
"""Added to a seeded request's seed for the draft's draws: the same numbers as the
verifier's would correlate the proposals with their acceptance tests."""


@dataclass
class _DraftRequest:
    fed: list[int] = field(default_factory=list)
    """Tokens whose KV the draft cache holds, from position 0."""
    block_ids: list[int] = field(default_factory=list)


class DraftModelProposer:
    def __init__(self, runner, num_speculative_tokens: int, num_blocks: int) -> None:
        """runner: a ModelRunner over the draft model, its KV cache of num_blocks allocated."""
        self.runner = runner
        self.k = num_speculative_tokens
        self.block_size = runner.block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.requests: dict[str, _DraftRequest] = {}
        self.probs: dict[str, torch.Tensor] = {}
        """Sampled requests' draft distributions of their last proposals, (k, vocab)."""
        self.generators = SeededGenerators(runner.device, salt=DRAFT_SEED_SALT)

    # ---- bookkeeping -------------------------------------------------------------------

    def remove(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.free_block_ids.extend(state.block_ids)
        self.probs.pop(request_id, None)
        self.generators.forget(request_id)

    def draft_probs(self, request_id: str, num_proposals: int) -> torch.Tensor | None:
        probs = self.probs.get(request_id)
        return None if probs is None else probs[:num_proposals]

    def _catch_up_start(self, state: _DraftRequest, real: np.ndarray) -> int:
        """How many of `fed` still match the real tokens (at most len(real) - 1)."""
        fed = np.asarray(state.fed[: len(real) - 1], dtype=np.int64)
        mismatch = np.flatnonzero(fed != real[: len(fed)])
        return int(mismatch[0]) if len(mismatch) else len(fed)

    def _reserve(self, state: _DraftRequest, num_positions: int) -> bool:
        needed = -(-num_positions // self.block_size) - len(state.block_ids)
        if needed > len(self.free_block_ids):
            return False
        state.block_ids += [self.free_block_ids.popleft() for _ in range(max(needed, 0))]
        return True

    # ---- proposing ---------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], batch: InputBatch) -> dict[str, list[int]]:
        runnable, starts, reals = [], [], []
        for state in states:
            real = batch.token_ids[state.row, : batch.num_tokens[state.row]]
            draft = self.requests.setdefault(state.request_id, _DraftRequest())
            start = self._catch_up_start(draft, real)
            del draft.fed[start:]
            if not self._reserve(draft, len(real) + self.k - 1):
                self.remove(state.request_id)  # out of draft blocks: no proposals this time
                continue
            runnable.append(state)
            starts.append(start)
            reals.append(real)
        if not runnable:
            return {}
        drafts = [self.requests[s.request_id] for s in runnable]
        tables = np.zeros((len(drafts), max(len(d.block_ids) for d in drafts)), dtype=np.int64)
        for row, d in enumerate(drafts):
            tables[row, : len(d.block_ids)] = d.block_ids
        num_computed = np.asarray(starts, dtype=np.int64)
        num_scheduled = np.asarray([len(r) for r in reals], dtype=np.int64) - num_computed
        input_ids = np.concatenate([r[start:] for r, start in zip(reals, starts)])
        proposals: list[list[int]] = [[] for _ in runnable]
        probs: list[list[torch.Tensor]] = [[] for _ in runnable]
        for _ in range(self.k):
            hidden = self.runner._forward(input_ids, num_computed, num_scheduled,
                                         self.runner.same_table_every_group(tables))
            last = torch.from_numpy(np.cumsum(num_scheduled) - 1).to(self.runner.device)
            logits = self.runner.model.head_logits(hidden[last]).float()  # (B, vocab)
            tokens = self._sample(runnable, logits, probs)
            fed_now = np.split(input_ids, np.cumsum(num_scheduled)[:-1])
            for d, fed, proposal, token in zip(drafts, fed_now, proposals, tokens):
                d.fed += fed.tolist()  # their KV is in the draft cache now
                proposal.append(token)
            input_ids = np.asarray(tokens, dtype=np.int64)
            num_computed = num_computed + num_scheduled
            num_scheduled = np.ones(len(runnable), dtype=np.int64)
        for state, rows in zip(runnable, probs):
            if rows:
                self.probs[state.request_id] = torch.stack(rows)
            else:
                self.probs.pop(state.request_id, None)
        return {s.request_id: p for s, p in zip(runnable, proposals)}

    def _sample(self, states: list[CachedRequestState], logits: torch.Tensor,
                probs: list[list[torch.Tensor]]) -> list[int]:
        """One draft token per request: argmax for greedy ones; else a draw from
        softmax(logits / temperature), whose distribution goes to probs[row]."""
        tokens = logits.argmax(dim=-1).tolist()
        for row, state in enumerate(states):
            temperature = state.sampling_params.temperature
            if temperature < SAMPLING_EPS:
                continue
            q = torch.softmax(logits[row] / temperature, dim=-1)
            tokens[row] = int(torch.multinomial(q, 1, generator=self.generators.get(state)))
            probs[row].append(q)
        return tokens


def load_draft_proposer(
    config: EngineConfig, target_runner, target_tokenizer, max_model_len: int,
) -> DraftModelProposer:
    """Load the draft named by config.speculative.model beside the target: same device,
    dtype and weight quantization, a KV cache with room for as many tokens as the target's
    plus k per sequence. ValueError if its tokenizer or vocabulary differ from the target's."""
    from pagoda.executor.model_runner import ModelRunner

    spec = config.speculative
    files = resolve_model_files(spec.model)
    checkpoint = open_checkpoint(files)
    check_same_tokenizer(target_tokenizer, load_tokenizer(files), spec.model)
    draft_vocab = int(checkpoint.hf_config.vocab_size)
    if draft_vocab != target_runner.vocab_size:
        raise ValueError(f"draft model {spec.model} has {draft_vocab} logits per token, the "
                         f"target {target_runner.vocab_size}: they must share one vocabulary")
    model = load_model(checkpoint, target_runner.dtype, target_runner.device,
                       max_position=max_model_len, quantization=config.model.quantization)
    cache_config = CacheConfig(block_size=config.cache.block_size)
    runner = ModelRunner(model, target_runner.device, target_runner.dtype, cache_config,
                         target_runner.eos_token_ids)
    per_sequence = -(-spec.num_speculative_tokens // config.cache.block_size) + 1
    num_blocks = target_runner.num_blocks + config.scheduler.max_num_seqs * per_sequence
    runner.initialize_kv_cache([num_blocks] * runner.num_kv_cache_groups)
    logger.info("draft model %s: %d KV blocks", spec.model, num_blocks)
    return DraftModelProposer(runner, spec.num_speculative_tokens, num_blocks)


def check_same_tokenizer(target, draft, draft_name: str) -> None:
    """ValueError naming the difference unless the draft's tokenizer has the target's
    vocabulary and special tokens."""
    if target.get_vocab() != draft.get_vocab():
        raise ValueError(f"draft model {draft_name} has a different tokenizer vocabulary "
                         f"({len(draft.get_vocab())} tokens, the target {len(target.get_vocab())} "
                         "or other ids): speculative decoding needs the target's tokenizer")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(target, name) != getattr(draft, name):
            raise ValueError(f"draft model {draft_name} has {name} {getattr(draft, name)}, the "
                             f"target {getattr(target, name)}: they must share special tokens")
