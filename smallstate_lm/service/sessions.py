"""Sessions: the last transcripts of a stream of utterances (a dictation, a call), kept in the engine where
every front-end sees them, so each request of a session is rescored after what was chosen for the ones before.

A session is named by the client and scoped to the API key it was made with; it keeps up to `context_utts`
transcripts, lives until deleted or idle for `ttl_s`, and at most `max_sessions` exist (their memory is bounded
by that, `context_utts` and `max_words`). Its requests take turns in arrival order: a request holds the session
(a lease) from the moment its context is read until its transcript is written back, and the next one waits; a
holder that never comes back (a front-end that died) loses the lease when its deadline passes."""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import LimitError, ServiceError


class SessionNotFound(ServiceError):
    kind = "session_not_found"


class SessionExists(ServiceError):
    kind = "session_exists"


class TooManySessions(LimitError):
    """max_sessions are open: a new one waits until one is deleted or expires (429)."""


def scope_of(api_key: str | None) -> str:
    """What sessions are scoped to: a digest of the API key a request came with (never the key itself)."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()[:16]


Reply = Callable[[list[list[str]] | None, BaseException | None], None]


@dataclass
class _Session:
    k: int
    said: deque = field(default_factory=deque)
    used: float = 0.0
    holder: str | None = None  # the lease holding it
    lease_until: float = 0.0
    waiting: deque = field(default_factory=deque)  # (lease, lease seconds, reply) in arrival order


class SessionStore:
    """The sessions of one engine. `acquire`'s reply is called at once when the session is free, else when the
    requests before it have released it (or lost their leases); `sweep` drops idle sessions and expired leases."""

    def __init__(self, max_sessions: int, ttl_s: float, max_context_utts: int, clock=time.monotonic):
        self.max_sessions, self.ttl_s, self.max_k, self.clock = max_sessions, ttl_s, max_context_utts, clock
        self.sessions: dict[tuple[str, str], _Session] = {}

    def _get(self, scope: str, name: str, now: float) -> _Session:
        s = self.sessions.get((scope, name))
        if s is None or (s.holder is None and not s.waiting and now - s.used > self.ttl_s):
            self.sessions.pop((scope, name), None)
            raise SessionNotFound(f"session {name!r} is unknown or expired (sessions end after {self.ttl_s:g} s "
                                  "without a request, or when deleted); create it with POST /v1/sessions",
                                  "session")
        return s

    def create(self, scope: str, name: str, k: int) -> dict:
        now = self.clock()
        self.sweep(now)
        if not 0 <= k <= self.max_k:
            raise LimitError(f"context_utts must lie in [0, {self.max_k}] (max_context_utts), got {k}",
                             "context_utts", self.max_k)
        if (scope, name) in self.sessions:
            raise SessionExists(f"session {name!r} exists already; delete it first or choose another id", "id")
        if len(self.sessions) >= self.max_sessions:
            raise TooManySessions(f"{len(self.sessions)} sessions are open, the limit (max_sessions); delete one or "
                                  f"wait for idle ones to expire ({self.ttl_s:g} s)", "id", self.max_sessions)
        self.sessions[(scope, name)] = s = _Session(k, used=now)
        return self.describe_session(name, s, now)

    def describe(self, scope: str, name: str) -> dict:
        now = self.clock()
        return self.describe_session(name, self._get(scope, name, now), now)

    def describe_session(self, name: str, s: _Session, now: float) -> dict:
        return {"id": name, "context_utts": s.k, "transcripts": [" ".join(w) for w in s.said],
                "expires_in_s": round(max(0.0, self.ttl_s - (now - s.used)), 3), "waiting": len(s.waiting)
                + (s.holder is not None)}

    def delete(self, scope: str, name: str) -> None:
        s = self._get(scope, name, self.clock())
        del self.sessions[(scope, name)]
        gone = SessionNotFound(f"session {name!r} was deleted while this request waited for it", "session")
        for _, _, reply in s.waiting:
            reply(None, gone)

    def acquire(self, scope: str, name: str, lease: str, lease_s: float, reply: Reply) -> None:
        """Queue the request of `lease` (an id unique to it, chosen by its front-end) for the session;
        `reply(context, None)` with its last transcripts (oldest first) once it is this request's turn, which it
        holds for at most `lease_s`, or `reply(None, error)`."""
        now = self.clock()
        s = self._get(scope, name, now)
        s.waiting.append((lease, lease_s, reply))
        s.used = now
        self._next(s, now)

    def release(self, scope: str, name: str, lease: str, said: list[str] | None) -> None:
        """The request of `lease` is done: its chosen transcript (None: it failed, nothing is added) is kept and
        the next request's turn comes. A lease that was taken away, or a session gone since, is ignored."""
        s = self.sessions.get((scope, name))
        if s is None:
            return
        now = self.clock()
        if s.holder != lease:
            s.waiting = deque(x for x in s.waiting if x[0] != lease)  # gave up before its turn
            return
        if said is not None and s.k > 0:
            s.said.append(list(said))
            while len(s.said) > s.k:
                s.said.popleft()
        s.holder, s.used = None, now
        self._next(s, now)

    def _next(self, s: _Session, now: float) -> None:
        if s.holder is not None or not s.waiting:
            return
        lease, lease_s, reply = s.waiting.popleft()
        s.holder, s.lease_until = lease, now + lease_s
        reply([list(w) for w in s.said], None)

    def sweep(self, now: float | None = None) -> None:
        """Leases past their deadline are taken back (their request's transcript is not added); sessions idle
        past `ttl_s` are dropped."""
        now = self.clock() if now is None else now
        for key, s in list(self.sessions.items()):
            if s.holder is not None and now > s.lease_until:
                s.holder = None
                self._next(s, now)
            if s.holder is None and not s.waiting and now - s.used > self.ttl_s:
                del self.sessions[key]
