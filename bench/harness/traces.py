"""Seeded synthetic chat traffic, emitted as token-id prompts for vLLM's /v1/completions.

The shape is the one that decides whether a KV cache pays off, so every part of it is explicit
in `TraceSpec`:

- **Shared system prompts.** `num_system_prompts` fixed prompts of `system_prompt_tokens`
  tokens; each new session picks one with Zipf(`system_zipf`) popularity (a few hot apps, a
  long tail). Every user of one app sends the same leading tokens: the cross-user, cross-instance
  reuse a shared pool exists for.
- **Multi-turn sessions.** A session has `turns_min..turns_max` turns. Turn k's prompt is the
  system prompt, then every earlier turn (user message + assistant reply), then the new user
  message, so each turn's prompt extends the previous turn's: the per-user reuse. The assistant
  replies in the history are synthetic tokens drawn by the trace, not the model's output, so a
  trace does not depend on what the model generates and replays identically everywhere.
  `concurrent_sessions` sessions are open at once and their turns interleave at random, which
  sets the reuse distance (how much other traffic passes between two turns of one user).
- **One-off requests.** A `one_off_share` of requests are unique prompts of `one_off_tokens`
  random tokens with no shared prefix: scan traffic that is never reused and only evicts.
- **Routing.** Each request carries `route`, a uniform 31-bit number; a fleet of N instances
  sends it to instance `route % N`. This models a load balancer without session affinity (round
  robin / least-loaded behave alike for reuse): a user's next turn usually lands on another
  instance, and every instance sees every system prompt.

Determinism: the whole trace comes from one `numpy.random.Generator(PCG64(seed))` drawn in a
fixed order, so one spec gives the same trace byte for byte; `Trace.fingerprint()` (sha256 of
prompts, routes, lengths and dependencies) is recorded with every result to prove it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Iterator, Sequence

import numpy as np

TRACE_FORMAT = "pegaflow-bench-trace/1"
ROUTE_BITS = 31


@dataclasses.dataclass(frozen=True)
class TraceSpec:
    seed: int = 0
    num_requests: int = 600
    vocab_size: int = 4096
    # Ids below this are the tokenizer's special tokens (<|endoftext|> is 0): never emitted, so a
    # prompt cannot contain an accidental end-of-text.
    first_token_id: int = 3
    num_system_prompts: int = 8
    system_prompt_tokens: int = 2048
    system_zipf: float = 1.0
    concurrent_sessions: int = 24
    turns_min: int = 2
    turns_max: int = 6
    user_turn_tokens: int = 256
    assistant_turn_tokens: int = 128
    one_off_share: float = 0.1
    one_off_tokens: int = 2048
    max_tokens: int = 16
    # Longest prompt the spec may produce; must leave room for max_tokens within the server's
    # --max-model-len.
    max_prompt_tokens: int = 8192

    def __post_init__(self) -> None:
        positive = (
            "num_requests",
            "vocab_size",
            "num_system_prompts",
            "system_prompt_tokens",
            "concurrent_sessions",
            "turns_min",
            "turns_max",
            "user_turn_tokens",
            "one_off_tokens",
            "max_tokens",
            "max_prompt_tokens",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TraceSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.assistant_turn_tokens, int) or self.assistant_turn_tokens < 0:
            raise ValueError(
                f"TraceSpec.assistant_turn_tokens must be an int >= 0, got {self.assistant_turn_tokens!r}"
            )
        if not 0 <= self.first_token_id < self.vocab_size - 1:
            raise ValueError(
                f"TraceSpec.first_token_id must be in [0, vocab_size - 1), got {self.first_token_id}"
            )
        if self.turns_min > self.turns_max:
            raise ValueError(f"TraceSpec.turns_min ({self.turns_min}) > turns_max ({self.turns_max})")
        if not 0.0 <= self.one_off_share <= 1.0:
            raise ValueError(f"TraceSpec.one_off_share must be in [0, 1], got {self.one_off_share}")
        if self.system_zipf < 0:
            raise ValueError(f"TraceSpec.system_zipf must be >= 0, got {self.system_zipf}")
        longest = max(self.longest_session_prompt(), self.one_off_tokens)
        if longest > self.max_prompt_tokens:
            raise ValueError(
                f"TraceSpec produces prompts of up to {longest} tokens, above max_prompt_tokens="
                f"{self.max_prompt_tokens}: lower turns_max or the per-turn sizes"
            )

    def longest_session_prompt(self) -> int:
        per_turn = self.user_turn_tokens + self.assistant_turn_tokens
        return self.system_prompt_tokens + (self.turns_max - 1) * per_turn + self.user_turn_tokens

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TraceSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown TraceSpec fields: {sorted(unknown)}")
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    index: int
    kind: str  # "session" or "one_off"
    session: int  # -1 for one-off requests
    turn: int  # 0-based turn within the session; 0 for one-off requests
    system_prompt: int  # index of the shared system prompt; -1 for one-off requests
    prompt: np.ndarray  # int32 token ids
    max_tokens: int
    route: int  # instance = route % num_instances
    depends_on: int | None  # index of the session's previous turn: sent only after it completed

    def instance(self, num_instances: int) -> int:
        if num_instances <= 0:
            raise ValueError(f"num_instances must be > 0, got {num_instances}")
        return self.route % num_instances

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "kind": self.kind,
            "session": self.session,
            "turn": self.turn,
            "system_prompt": self.system_prompt,
            "prompt": self.prompt.tolist(),
            "max_tokens": self.max_tokens,
            "route": self.route,
            "depends_on": self.depends_on,
        }

    @classmethod
    def from_json(cls, data: dict) -> TraceRequest:
        return cls(
            index=int(data["index"]),
            kind=str(data["kind"]),
            session=int(data["session"]),
            turn=int(data["turn"]),
            system_prompt=int(data["system_prompt"]),
            prompt=np.asarray(data["prompt"], dtype=np.int32),
            max_tokens=int(data["max_tokens"]),
            route=int(data["route"]),
            depends_on=None if data["depends_on"] is None else int(data["depends_on"]),
        )


@dataclasses.dataclass
class _OpenSession:
    session: int
    system_prompt: int
    turns: int
    history: np.ndarray
    turn: int = 0
    last_request: int | None = None


@dataclasses.dataclass(frozen=True)
class Trace:
    spec: TraceSpec
    requests: tuple[TraceRequest, ...]

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def fingerprint(self) -> str:
        digest = hashlib.sha256(TRACE_FORMAT.encode())
        for r in self.requests:
            head = (r.index, r.session, r.turn, r.system_prompt, r.max_tokens, r.route, r.depends_on)
            digest.update(repr(head).encode())
            digest.update(np.ascontiguousarray(r.prompt, dtype="<i4").tobytes())
        return digest.hexdigest()

    def summary(self) -> dict:
        lengths = np.array([len(r.prompt) for r in self.requests])
        kinds = [r.kind for r in self.requests]
        return {
            "requests": len(self.requests),
            "session_requests": kinds.count("session"),
            "one_off_requests": kinds.count("one_off"),
            "sessions": len({r.session for r in self.requests if r.session >= 0}),
            "prompt_tokens_total": int(lengths.sum()),
            "prompt_tokens_mean": float(lengths.mean()),
            "prompt_tokens_max": int(lengths.max()),
            "fingerprint": self.fingerprint(),
        }

    def save(self, path: str | pathlib.Path) -> None:
        """One JSON header line (format, spec, fingerprint), then one request per line."""
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            header = {"format": TRACE_FORMAT, "spec": self.spec.to_dict(), "fingerprint": self.fingerprint()}
            f.write(json.dumps(header) + "\n")
            for r in self.requests:
                f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Trace:
        with pathlib.Path(path).open() as f:
            header = json.loads(f.readline())
            if header.get("format") != TRACE_FORMAT:
                raise ValueError(f"{path}: not a {TRACE_FORMAT} file (format={header.get('format')!r})")
            requests = tuple(TraceRequest.from_json(json.loads(line)) for line in f if line.strip())
        trace = cls(TraceSpec.from_dict(header["spec"]), requests)
        if trace.fingerprint() != header["fingerprint"]:
            raise ValueError(f"{path}: fingerprint mismatch: the file was modified or truncated")
        return trace


def generate(spec: TraceSpec) -> Trace:
    """Builds the trace of `spec`. Draw order is part of the format: change it and fingerprints change."""
    rng = np.random.default_rng(spec.seed)
    lo, hi = spec.first_token_id, spec.vocab_size

    def tokens(n: int) -> np.ndarray:
        return rng.integers(lo, hi, size=n, dtype=np.int32)

    system_prompts = [tokens(spec.system_prompt_tokens) for _ in range(spec.num_system_prompts)]
    ranks = np.arange(1, spec.num_system_prompts + 1, dtype=np.float64)
    popularity = ranks ** (-spec.system_zipf)
    popularity /= popularity.sum()
    next_session = 0

    def open_session() -> _OpenSession:
        nonlocal next_session
        system = int(rng.choice(spec.num_system_prompts, p=popularity))
        turns = int(rng.integers(spec.turns_min, spec.turns_max + 1))
        s = _OpenSession(next_session, system, turns, system_prompts[system])
        next_session += 1
        return s

    open_sessions = [open_session() for _ in range(spec.concurrent_sessions)]
    requests: list[TraceRequest] = []
    for index in range(spec.num_requests):
        route = int(rng.integers(0, 1 << ROUTE_BITS))
        if rng.random() < spec.one_off_share:
            requests.append(
                TraceRequest(
                    index, "one_off", -1, 0, -1, tokens(spec.one_off_tokens), spec.max_tokens, route, None
                )
            )
            continue
        slot = int(rng.integers(len(open_sessions)))
        s = open_sessions[slot]
        prompt = np.concatenate([s.history, tokens(spec.user_turn_tokens)])
        requests.append(
            TraceRequest(
                index,
                "session",
                s.session,
                s.turn,
                s.system_prompt,
                prompt,
                spec.max_tokens,
                route,
                s.last_request,
            )
        )
        s.history = np.concatenate([prompt, tokens(spec.assistant_turn_tokens)])
        s.turn += 1
        s.last_request = index
        if s.turn == s.turns:
            open_sessions[slot] = open_session()
    return Trace(spec, tuple(requests))


def split_by_instance(trace: Trace | Sequence[TraceRequest], num_instances: int) -> list[list[TraceRequest]]:
    """The requests each instance of a fleet of `num_instances` receives, in trace order."""
    out: list[list[TraceRequest]] = [[] for _ in range(num_instances)]
    for r in trace:
        out[r.instance(num_instances)].append(r)
    return out
