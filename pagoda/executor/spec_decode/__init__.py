"""Speculative decoding: proposers guess a request's next k tokens cheaply, the target model
scores all of them in the step's one forward, and rejection sampling keeps the longest prefix
that the target's distribution would have produced (exact for greedy, distribution-preserving
for sampling).

    ngram_proposer.py     prompt lookup: the tokens that followed the last n-gram before
    draft_proposer.py     a smaller model with its own paged KV cache proposes k tokens
    adaptive.py           per request: stop proposing while proposals are mostly rejected
    decoder.py            the runner's side: picks the proposer, keeps the adaptivity
    rejection_sampler.py  verification: accepted prefix + one sampled token per request

The scheduling side lives in the scheduler (proposals scheduled after a request's last token,
their slots rolled back when rejected: step_data.py has the picture).
"""
