"""`pagoda bench soak`'s workload: what is sent (soak.py sends it and checks the answers).

Seeded: the greedy templates whose answers are taken alone first, then a mix of completions,
chat, responses and embeddings, sampled and greedy, streamed or not, with stops, logprobs,
n > 1, disconnects and cancels, and client-shaped chat requests (soak_shapes.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pagoda.bench.soak_shapes import SHAPES, shape_fields

WORDS = ["river", "stone", "lantern", "orchard", "copper", "meadow", "harbor", "violet", "canyon", "ember", "thistle", "compass", "glacier", "willow", "beacon", "saffron", "quarry", "falcon", "ribbon", "tundra"]
SHORT_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time",
                 "List three colors:", "The opposite of hot is", "Write a haiku about rain.")
STOPS = (["\n"], [".", "!"], ["the"], None)
SHAPE_SHARE = 0.5
"""Of the sampled chat requests, this share asks for a forced tool call or a JSON schema."""
RESPONSES_SHARE = 0.4
"""Of the chat requests without stop strings, this share goes to /v1/responses (n 1, no
logprobs); a greedy one is checked against its chat template's reference."""
EMBEDDING_SHARE = 0.125


@dataclass(frozen=True)
class SoakRequest:
    index: int
    endpoint: str
    """"completions", "chat", "responses" or "embeddings"."""
    prompt: str
    """The prompt (completions), the user message (chat) or the input (embeddings)."""
    max_tokens: int
    stream: bool
    n: int = 1
    temperature: float = 0.0
    """0: greedy, checked against the reference of `template`."""
    seed: int | None = None
    stop: list[str] | None = None
    logprobs: bool = False
    fate: str = "complete"
    """"complete", "disconnect" (close the stream after its first chunk) or "cancel" (give
    up after `cancel_after` seconds)."""
    cancel_after: float = 0.0
    template: int | None = None
    """The greedy template this request repeats (None: not greedy)."""
    shape: str | None = None
    """A client-shaped chat request (soak_shapes.py: "tool" or "json"), checked whole."""

    def payload(self) -> dict:
        if self.endpoint == "responses":
            return {"input": self.prompt, "max_output_tokens": self.max_tokens,
                    "temperature": self.temperature, "stream": self.stream}
        if self.endpoint == "embeddings":
            return {"input": self.prompt}
        body: dict = {"max_tokens": self.max_tokens, "temperature": self.temperature,
                      "n": self.n, "stream": self.stream}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop is not None:
            body["stop"] = self.stop
        if self.logprobs:
            body.update({"logprobs": True, "top_logprobs": 2} if self.endpoint == "chat"
                        else {"logprobs": 2})
        if self.shape is not None:
            body.update(shape_fields(self.shape))
        return body


def _long_prompt(rng: np.random.Generator, num_words: int) -> str:
    return "Summarize: " + " ".join(rng.choice(WORDS, size=num_words)) + "."


def greedy_templates(seed: int, count: int = 12) -> list[SoakRequest]:
    """The greedy requests the load repeats: each endpoint, short and long prompts, stops."""
    rng = np.random.default_rng(seed)
    templates = []
    for i in range(count):
        long = i % 3 == 2
        templates.append(SoakRequest(
            index=-1 - i, endpoint="chat" if i % 2 else "completions",
            prompt=_long_prompt(rng, 300) if long else SHORT_PROMPTS[i % len(SHORT_PROMPTS)],
            max_tokens=int(rng.integers(8, 48)), stream=False,
            stop=STOPS[i % len(STOPS)], template=i,
        ))
    return templates


def embedding_inputs(seed: int) -> list[str]:
    """The inputs embedding requests draw from: the short prompts and two long ones."""
    rng = np.random.default_rng(seed + 4)
    return list(SHORT_PROMPTS) + [_long_prompt(rng, 200), _long_prompt(rng, 350)]


def soak_workload(num_requests: int, seed: int, templates: list[SoakRequest],
                  embeddings: bool = True) -> list[SoakRequest]:
    """`num_requests` requests: about half greedy repeats of `templates` (n up to 3, any
    delivery, some with logprobs), the rest seeded sampling; one in eight disconnects, one
    in sixteen cancels; with `embeddings`, one in eight is an embedding of one of
    embedding_inputs (one in eight of those cancelled)."""
    rng = np.random.default_rng(seed + 1)
    requests = []
    for index in range(num_requests):
        stream = bool(rng.random() < 0.5)
        fate = "complete"
        draw = rng.random()
        if draw < 0.125 and stream:
            fate = "disconnect"
        elif draw < 0.1875:
            fate = "cancel"
        common = {"index": index, "stream": stream, "fate": fate,
                  "cancel_after": float(rng.uniform(0.05, 1.0)),
                  "n": int(rng.choice([1, 1, 1, 2, 3])), "logprobs": bool(rng.random() < 0.25)}
        if rng.random() < 0.5:
            template = templates[int(rng.integers(len(templates)))]
            requests.append(SoakRequest(
                endpoint=template.endpoint, prompt=template.prompt,
                max_tokens=template.max_tokens, stop=template.stop, template=template.template,
                **common))
        else:
            long = rng.random() < 0.25
            requests.append(SoakRequest(
                endpoint=str(rng.choice(["completions", "chat"])),
                prompt=_long_prompt(rng, int(rng.integers(150, 400))) if long
                else str(rng.choice(SHORT_PROMPTS)),
                max_tokens=int(rng.integers(4, 96)), temperature=0.8,
                seed=int(rng.integers(1 << 30)), stop=STOPS[int(rng.integers(len(STOPS)))],
                **common))
    share = np.random.default_rng(seed + 2)  # its own draws: the rest stays as it was
    requests = [replace(r, endpoint="responses", n=1, logprobs=False)
                if r.endpoint == "chat" and r.stop is None and share.random() < RESPONSES_SHARE
                else r for r in requests]
    shapes = np.random.default_rng(seed + 5)  # sampled chat requests made client-shaped
    requests = [replace(r, shape=SHAPES[int(shapes.integers(len(SHAPES)))], stream=False,
                        fate="complete" if r.fate == "disconnect" else r.fate, logprobs=False,
                        stop=None)
                if r.endpoint == "chat" and r.template is None and shapes.random() < SHAPE_SHARE
                else r for r in requests]
    return with_embeddings(requests, seed) if embeddings else requests


def with_embeddings(requests: list[SoakRequest], seed: int) -> list[SoakRequest]:
    """One request in eight replaced by an embedding of one of embedding_inputs (one in
    eight of those cancelled), by draws of its own: the other requests stay as they were."""
    rng = np.random.default_rng(seed + 3)
    inputs = embedding_inputs(seed)
    mixed = []
    for request in requests:
        if rng.random() < EMBEDDING_SHARE:
            cancel = bool(rng.random() < 0.125)
            request = SoakRequest(
                index=request.index, endpoint="embeddings",
                prompt=inputs[int(rng.integers(len(inputs)))], max_tokens=0, stream=False,
                fate="cancel" if cancel else "complete",
                cancel_after=float(rng.uniform(0.01, 0.2)))
        mixed.append(request)
    return mixed
