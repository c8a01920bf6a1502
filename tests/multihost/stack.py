"""An EPD deployment on the rig, every stage on its own host, wired only by the product's flags,
and the checks its tests share: greedy parity with Hugging Face ``generate()`` through the router
(the official client, from the client host), the (P, D) pair of each request, listeners.

``start_stack(rig, transfer, encoders=("e1", "e2"), prefills=("p1", "p2"), decodes=("d1", "d2"))``
    Redis (with a password) on ``redis``, the stages on their hosts (started at once), then the
    router on ``router`` with round-robin P and D policies and ``ADMIN_TOKEN``. Each prefill's and
    decode's ``--group`` is its host's name; each decode's ``--allowed-bootstrap`` is exactly the
    prefills' bootstrap addresses.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import cached_property

import httpx
import openai
import torch
from PIL import Image as PILImage

from stages.engine.models import load_adapter
from stages.prompt import PromptBuilder
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_greedy, load_reference
from tests.multihost.rig import BOOTSTRAP_PORT, Rig, Server
from tests.support.router_helpers import data_url, messages, png

VARIANT = "qwen2_vl"
STEPS = 6
ADMIN_TOKEN = "rig-admin-token-0123456789abcdef"
STAGE_FLAGS = ("--kv-cache-mib", "16")
CASES = {"text": ("hello, who are you?", []), "one_image": ("what is it", [(64, 64)]),
         "three_images": ("compare them", [(64, 64), (96, 128), (40, 72)])}
# Mooncake's two documented wildcard listeners (tests/stages/test_listeners.py) are in its RPC port range
MOONCAKE_PORTS = (15000, 17000)


@dataclass
class Stack:
    rig: Rig
    transfer: str
    encoders: list[Server]
    prefills: list[Server]
    decodes: list[Server]
    router: Server

    @property
    def stages(self) -> list[Server]:
        return [*self.encoders, *self.prefills, *self.decodes]

    def get(self, url: str, **kwargs) -> httpx.Response:
        """GET ``url`` from the client host."""
        return self.rig.client(httpx.get, url, timeout=10, **kwargs)

    def admin(self, method: str, path: str, token: str | None = ADMIN_TOKEN, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return self.rig.client(httpx.request, method, f"{self.router.url}{path}", headers=headers, timeout=10,
                               **kwargs)

    def blocks_used(self) -> list[int]:
        return [self.get(f"{s.url}/server_info").json()["kv_blocks"]["used"] for s in (*self.prefills, *self.decodes)]


def start_stack(rig: Rig, transfer: str, encoders: tuple[str, ...] = ("e1", "e2"),
                prefills: tuple[str, ...] = ("p1", "p2"), decodes: tuple[str, ...] = ("d1", "d2")) -> Stack:
    rig.start_redis()
    model = ("--model", str(model_dir(VARIANT)))
    allowed = ",".join(rig.hostport(p, BOOTSTRAP_PORT) for p in prefills)
    jobs = [(h, "encoder", *model) for h in encoders]
    jobs += [(h, "prefill", *model, *STAGE_FLAGS, "--transfer", transfer, "--group", h) for h in prefills]
    jobs += [(h, "decode", *model, *STAGE_FLAGS, "--transfer", transfer, "--group", h,
              "--allowed-bootstrap", allowed) for h in decodes]
    servers = rig.start_all(jobs)
    found = iter(servers)
    e, p, d = ([next(found) for _ in hosts] for hosts in (encoders, prefills, decodes))
    workers = [flag for role, group in (("--encoder", e), ("--prefill", p), ("--decode", d))
               for server in group for flag in (role, server.url)]
    router = rig.start("router", "router", *workers, "--policy-prefill", "round_robin", "--policy-decode",
                       "round_robin", "--admin-token", ADMIN_TOKEN, "--health-interval-s", "0.5")
    return Stack(rig, transfer, e, p, d, router)


class Reference:
    """Hugging Face ``generate()`` on the stack's checkpoint: the expected greedy text of a request."""

    @cached_property
    def _parts(self):
        path = model_dir(VARIANT)
        adapter = load_adapter(path, torch.float32, "sdpa")
        return load_reference(path), adapter.image_token_id, PromptBuilder.load(path, adapter)

    def expected(self, text: str, images: list[bytes], steps: int = STEPS) -> tuple[str, int, int]:
        """(text, prompt tokens, completion tokens) of greedy generation."""
        model, image_token_id, prompts = self._parts
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = prompts.build([{"role": "user", "content": parts}], [PILImage.open(io.BytesIO(b)) for b in images])
        tokens = hf_greedy(model, prompt, image_token_id, steps)
        return prompts.tokenizer.decode(tokens, skip_special_tokens=True), len(prompt.token_ids), len(tokens)


def case_images(case: str, salt: int) -> list[bytes]:
    """The PNGs of ``case``; ``salt`` makes them new to the cache (each transfer, each mode)."""
    text, sizes = CASES[case]
    return [png(w, h, seed=1000 * salt + 10 * sorted(CASES).index(case) + i) for i, (w, h) in enumerate(sizes)]


def ask(base_url: str, text: str, images: list[bytes], stream: bool, steps: int = STEPS) -> tuple[str, dict]:
    """Greedy text and usage through the official client (run it on the client host)."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
    try:
        kwargs = dict(model=client.models.list().data[0].id, messages=messages(text, [data_url(b) for b in images]),
                      max_tokens=steps, temperature=0)
        if not stream:
            reply = client.chat.completions.create(**kwargs)
            return reply.choices[0].message.content, reply.usage.model_dump()
        out, usage = "", None
        for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                out += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
        return out, usage
    finally:
        client.close()


def pair_of(stack: Stack, body: dict) -> tuple[tuple[str, str], str]:
    """Send ``body`` through the router (client host); the (prefill host, decode host) that served it,
    as the router's room record names them, each confirmed by that stage's own ``/rooms/{room}``,
    and the answer's text."""
    response = stack.rig.client(httpx.post, f"{stack.router.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    room = response.headers["x-epd-room"]
    record = stack.admin("GET", f"/admin/rooms/{room}").json()
    hosts = {s.url: s.host for s in stack.stages}
    stages = record["stages"]
    prefill, decode = stages["prefill"], stages["decode"]
    for stage in (prefill, decode):
        assert stage.get("events"), f"room {room}: {stage}"
    return (hosts[prefill["url"]], hosts[decode["url"]]), response.json()["choices"][0]["message"]["content"]
