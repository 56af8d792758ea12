"""LangChain's own standard integration tests (`langchain-tests`), unchanged, for ChatOpenAI and
ChatOllama pointed at a Corral (`CORRAL_URL`, its model `CORRAL_MODEL`). Run by
compat/test_tools.py in the compat venv; a failure here is Corral's or the model's, and the
figures in docs/benchmarks.md say which."""

from __future__ import annotations

import os
from typing import Any

from langchain_ollama import ChatOllama
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

URL = os.environ.get("CORRAL_URL", "http://127.0.0.1:8080")
MODEL = os.environ.get("CORRAL_MODEL", "coder")
# A cap for a real small model, which may never stop on its own (the demo's models do).
CAP = int(os.environ.get("CORRAL_MAX_TOKENS", "0")) or None


class TestCorralChatOpenAI(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict[str, Any]:
        params = {"model": MODEL, "base_url": f"{URL}/v1", "api_key": "corral",
                  "stream_usage": True}  # fmt: skip
        return {**params, "max_tokens": CAP} if CAP else params

    @property
    def supports_json_mode(self) -> bool:
        return True


class TestCorralChatOllama(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatOllama]:
        return ChatOllama

    @property
    def chat_model_params(self) -> dict[str, Any]:
        params = {"model": MODEL, "base_url": URL}
        return {**params, "num_predict": CAP} if CAP else params

    @property
    def supports_json_mode(self) -> bool:
        return True
