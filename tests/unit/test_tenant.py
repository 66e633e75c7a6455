"""The gateway tells the drafter whose request a sequence is (SequenceSpec.tenant): a digest of
the API key where keys are required, else one shared tenant; the key itself never leaves."""

from __future__ import annotations

import asyncio
import json

import httpx
from api_harness import CHAT, MODEL, RefusingScheduler

from gateway.api.limits import tenant
from gateway.api.openai_api import OpenAIApi

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def post(tok, keyed: bool, key: str) -> RefusingScheduler:
    scheduler = RefusingScheduler()
    api = OpenAIApi(scheduler, tok, MODEL, health=None)  # type: ignore[arg-type]
    api.keyed = keyed
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app()), base_url="http://g") as client:
            return await client.post(CHAT, content=json.dumps(BODY), headers=headers)

    asyncio.run(go())
    return scheduler


def test_a_keyed_request_is_its_keys_tenant_and_the_key_is_not_sent(tok):
    scheduler = post(tok, keyed=True, key="sk-one")
    assert scheduler.tenants == [tenant("sk-one")]
    assert "sk-one" not in scheduler.tenants[0]
    assert tenant("sk-one") != tenant("sk-two")


def test_without_keys_every_request_is_one_tenant(tok):
    assert post(tok, keyed=False, key="sk-one").tenants == [""]
