"""The agent endpoint: an OpenAI-compatible HTTP server over a producer's rollouts.

    endpoint = AgentEndpoint(host="127.0.0.1", token=secrets.token_hex(16))
    await endpoint.start()                  # in the producer actor's event loop; address: http://127.0.0.1:PORT
    session = endpoint.open(ctx)            # ctx.endpoint = session: base_url, api_key, reward_url
    ...                                     # the agent calls base_url with any OpenAI client
    endpoint.close(session)                 # the rollout ended: later calls get 404

Routes (every one needs `Authorization: Bearer <token>`, what the OpenAI client sends as its api_key):

    POST /sessions/{session}/v1/chat/completions     POST /v1/chat/completions + header X-Session-Id
    POST /sessions/{session}/v1/completions          POST /v1/completions      + header X-Session-Id
    POST /sessions/{session}/v1/responses            POST /v1/responses        + header X-Session-Id
    GET  /sessions/{session}/v1/models               POST /sessions/{session}/reward  {"reward": 1.0}

A request names its rollout by the session id in its path (what a `base_url` carries), or by
the `X-Session-Id` header on the bare /v1 routes. What a request may ask and how it is
answered: vgbs_ray/agents/openai_protocol.py. Errors are OpenAI error bodies: 400 for a bad
field, malformed JSON or a request longer than the engine takes, 401 without the token and 403
with a wrong one, 404 for an unknown or ended session, 409 for a second reward (also once the
session ended: the last 100,000 ended sessions are remembered); none of them touches another
session. 501 for `tools` when the job's tool parser cannot run; 503 when the engines failed (the
producer then fails, as for a Python agent). `stream: true` answers server-sent events.

The server listens on loopback, or on the node's private address (`host="node"`) so agents on
other nodes of the cluster reach it; never on every interface. It runs inside the producer's
asyncio actor, next to the rollouts' contexts, so requests go through the producer's batched
engine calls like a Python agent's.
"""

from __future__ import annotations

import collections
import hmac
import json
import logging
import secrets

from aiohttp import web

from vgbs_ray.agents.context import RolloutContext
from vgbs_ray.agents.openai_protocol import EndpointRollout, EndpointSession, ProtocolError, stream_chunks
from vgbs_ray.agents.responses_protocol import response_events
from vgbs_ray.agents.tool_calls import ToolCallParser
from vgbs_ray.errors import ConfigError

log = logging.getLogger("vgbs.endpoint")

SESSION_HEADER = "X-Session-Id"
ROLLOUT_HEADER = "X-Rollout-Id"
"""Every completion's answer names the rollout it trains as."""
ENDED_SESSIONS_KEPT = 100_000
"""Ended session ids remembered for a late request's `session_ended` answer (~100 bytes each)."""
REFUSALS_LOGGED = 20
"""The first refusals each endpoint logs (the client gets every one in its error body)."""


def listen_address(host: str) -> str:
    """'loopback' -> 127.0.0.1; 'node' -> this node's private address (Ray's); anything else is refused."""
    if host == "loopback":
        return "127.0.0.1"
    if host == "node":
        import ray

        return ray.util.get_node_ip_address()
    raise ConfigError(f"rollout.endpoint.host={host!r} must be 'loopback' or 'node' (the node's private "
                      "address); the endpoint never listens on every interface")


class AgentEndpoint:
    """See module docstring."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, token: str, tool_parser: str | None = None):
        if not token or len(token) < 16:
            raise ConfigError("AgentEndpoint needs a token of at least 16 characters")
        self._host, self._port, self._token = host, port, token
        self._tool_parser_name = tool_parser
        self._tool_parser: ToolCallParser | None = None
        self._sessions: dict[str, EndpointRollout] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        """The most recent ended sessions (a reward report to one is a 409, not an unknown session's 404)."""
        self.outcomes: dict[str, int] = {}
        """Over every session: tool-call parse outcomes (`tool_calls/<outcome>`) and new samples (a request extending no held conversation)."""
        self._runner: web.AppRunner | None = None
        self.address: str | None = None
        self.refused = 0
        """Requests answered with a 4xx, except those to a session that had ended (`after_end`)."""
        self.after_end = 0
        """Requests to a session that had ended: an agent still running after its group ended (the job stopping,
        the group's timeout, a member's failure) or reporting a settled reward. Counted apart from `refused`:
        most are the job's doing, not a malformed request."""

    async def start(self) -> str:
        app = web.Application(middlewares=[self._errors_and_auth], client_max_size=64 << 20)
        for prefix, session_in in (("/sessions/{session}", "path"), ("", "header")):
            app.router.add_post(f"{prefix}/v1/chat/completions", self._handler("chat", session_in))
            app.router.add_post(f"{prefix}/v1/completions", self._handler("completion", session_in))
            app.router.add_post(f"{prefix}/v1/responses", self._handler("responses", session_in))
            app.router.add_get(f"{prefix}/v1/models", self._handler("models", session_in))
        app.router.add_post("/sessions/{session}/reward", self._handler("reward", "path"))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, backlog=4096)
        await site.start()
        port = self._runner.addresses[0][1]
        self.address = f"http://{self._host}:{port}"
        log.info("agent endpoint listening on %s", self.address)
        return self.address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, context: RolloutContext) -> EndpointSession:
        """A session for this rollout; sets `context.endpoint`."""
        session_id = f"{context.rollout_id}-{secrets.token_hex(4)}"
        if self._tool_parser is None and self._tool_parser_name is not None and context.tokenizer is not None:
            self._tool_parser = ToolCallParser(self._tool_parser_name, context.tokenizer)
        rollout = EndpointRollout(context, self._tool_parser, self.outcomes)
        self._sessions[session_id] = rollout
        context.endpoint = EndpointSession(address=self.address, session_id=session_id, api_key=self._token,
                                           rollout=rollout)
        return context.endpoint

    def close(self, session: EndpointSession) -> None:
        if self._sessions.pop(session.session_id, None) is not None:
            self._ended[session.session_id] = None
            while len(self._ended) > ENDED_SESSIONS_KEPT:
                self._ended.popitem(last=False)

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    # -- HTTP -----------------------------------------------------------------------------------

    @web.middleware
    async def _errors_and_auth(self, request: web.Request, handler):
        try:
            header = request.headers.get("Authorization", "")
            if not header.startswith("Bearer "):
                raise ProtocolError("missing 'Authorization: Bearer <token>' (the job's endpoint token; an OpenAI "
                                    "client sends its api_key so)", status=401)
            if not hmac.compare_digest(header[len("Bearer "):].encode(), self._token.encode()):
                raise ProtocolError("wrong token for this endpoint", status=403)
            return await handler(request)
        except ProtocolError as error:
            if error.code == "session_ended":
                self.after_end += 1
            else:
                self.refused += 1
                if self.refused <= REFUSALS_LOGGED:
                    log.warning("endpoint refused %s %s (%d): %s", request.method, request.path, error.status, error)
            return web.json_response(error.body(), status=error.status)

    def _handler(self, kind: str, session_in: str):
        async def handle(request: web.Request) -> web.Response:
            session_id = (request.match_info.get("session") if session_in == "path"
                          else request.headers.get(SESSION_HEADER))
            if not session_id:
                raise ProtocolError(f"no session: use a base_url of /sessions/{{session}}/v1, or the {SESSION_HEADER} "
                                    "header", status=404)
            rollout = self._sessions.get(session_id)
            if rollout is None and session_id in self._ended:
                raise ProtocolError(f"session {session_id!r} has ended: its rollout's reward is settled" if kind == "reward"
                                    else f"session {session_id!r} has ended (its group finished, failed, timed out or "
                                    "the job is stopping)", status=409 if kind == "reward" else 404, code="session_ended")
            if rollout is None:
                raise ProtocolError(f"unknown or ended session {session_id!r}", status=404)
            if kind == "models":
                return web.json_response({"object": "list", "data": [
                    {"id": "policy", "object": "model", "created": 0, "owned_by": "vgbs-ray"}]})
            try:
                body = await request.json(loads=_strict_json)
            except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as error:
                raise ProtocolError(f"the request body is not JSON: {error}") from None
            if not isinstance(body, dict):
                raise ProtocolError("the request body must be a JSON object")
            if kind == "reward":
                rollout.report_reward(body)
                return web.json_response({"session": session_id, "reward": body["reward"]})
            try:
                answer = await {"chat": rollout.chat_completion, "completion": rollout.completion,
                                "responses": rollout.response}[kind](body)
            except ProtocolError:
                raise
            except Exception as error:  # noqa: BLE001 - an engine failure: this request fails, the producer decides
                log.error("session %s: %s failed: %r", session_id, kind, error)
                rollout.fatal_error = error
                return web.json_response({"error": {"message": f"the engines failed: {error!r}", "type": "api_error",
                                                    "param": None, "code": None}}, status=503)
            headers = {ROLLOUT_HEADER: str(rollout.context.rollout_id)}
            if body.get("stream") and kind == "responses":
                return await _stream(request, response_events(answer), headers, named_events=True)
            if body.get("stream"):
                return await _stream(request, stream_chunks(answer, (body.get("stream_options") or {}).get(
                    "include_usage", False)), headers)
            return web.json_response(answer, headers=headers)

        return handle


async def _stream(request: web.Request, chunks: list[dict], headers: dict, *, named_events: bool = False
                  ) -> web.StreamResponse:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]` (chat and completions); with
    `named_events` (the Responses API), each event's `event:` line is its type and no [DONE] follows. A client
    gone mid-stream changes nothing: the generation was recorded before the first chunk."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await response.prepare(request)
    try:
        for chunk in chunks:
            named = f"event: {chunk['type']}\n" if named_events else ""
            await response.write(f"{named}data: {json.dumps(chunk)}\n\n".encode())
        if not named_events:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except (ConnectionResetError, ConnectionError):
        log.info("a client closed its stream early; its generation is recorded")
    return response


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)
