"""Start-up of speculative decoding: the SpecDecoder a ModelRunner uses; for a draft model,
the draft loaded like the target (same device and dtype), its tokenizer checked against the
target's, and a paged KV cache of its own."""

from __future__ import annotations

import logging

from pagoda.config import EngineConfig
from pagoda.executor.spec_decode.decoder import SpecDecoder

logger = logging.getLogger(__name__)


def build_spec_decoder(
    config: EngineConfig, runner, tokenizer, max_model_len: int,
) -> SpecDecoder:
    spec = config.speculative
    draft_proposer = None
    if spec.method == "draft_model":
        from pagoda.executor.spec_decode.draft_proposer import load_draft_proposer

        draft_proposer = load_draft_proposer(config, runner, tokenizer, max_model_len)
    logger.info("speculative decoding: %s, %d tokens per step%s", spec.method,
                spec.num_speculative_tokens,
                f", n-grams of {spec.prompt_lookup_min}..{spec.prompt_lookup_max}"
                if spec.method == "ngram" else f", draft {spec.model}")
    return SpecDecoder(spec, draft_proposer)
