"""chatapp against a real OpenAI-compatible endpoint: llmgw's throwaway host."""

from __future__ import annotations

import httpx
from chatapp import one_line_answer


def test_the_app_gets_a_one_line_answer(llmgw_openai, llmgw_endpoint) -> None:
    # llmgw's tiny test model has random weights: it may sample its end token first.
    answer = one_line_answer(llmgw_openai, llmgw_endpoint.model, "What is a GPU?",
                             extra_body={"ignore_eos": True})
    assert answer and "\n" not in answer


def test_the_model_is_listed_by_the_gateway(llmgw_endpoint) -> None:
    headers = {"Authorization": f"Bearer {llmgw_endpoint.key}"} if llmgw_endpoint.key else {}
    r = httpx.get(f"{llmgw_endpoint.base_url}/models", headers=headers, timeout=10)
    assert llmgw_endpoint.model in [m["id"] for m in r.json()["data"]]


def test_the_catalog_holds_the_model(llmgw_admin, llmgw_endpoint) -> None:
    assert llmgw_endpoint.model in [m["name"] for m in llmgw_admin.models()]
