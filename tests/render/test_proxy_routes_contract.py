"""The EPD proxy's reading of vLLM's API, checked against the real vLLM 0.32, 0.33 and 0.34: every POST
route either has its media primed, is refused, or is known to run no encoder on a consumer's
media (which media of a primed route's request are primed: test_media_parts_contract.py)."""

from __future__ import annotations

import pytest

from epd_dataplane import core
from epd_dev.vllm.cli_parser import VllmParser

# vLLM's POST routes that the proxy passes through, and why none of them has a consumer encode
# a client's media.
NO_ENCODER_ROUTES = {
    # Tokenize or render only: the HF processor counts placeholders, no engine step runs.
    "/tokenize": "tokenizes",
    "/detokenize": "tokens in, text out",
    "/v1/messages/count_tokens": "tokenizes",
    "/v1/chat/completions/render": "renders (epd_client's rollouts prime, then generate); keyed: core.KEYED_ROUTES",
    "/v1/completions/render": "renders",
    "/v1/responses/render": "renders; keyed: core.KEYED_ROUTES",
    "/v1/messages/render": "renders",
    "/cohere/v2/chat/render": "renders",
    "/v1/chat/completions/derender": "tokens in, text out",
    "/v1/completions/derender": "tokens in, text out",
    # Generation without media.
    "/v1/completions": "a text or token prompt",
    "/inference/v1/generate": "tokens and the features render gave; the rollout primed them (epd_client)",
    "/generative_scoring": "text or token ids",
    "/v1/decisions": "text only: vLLM 0.33 refuses an input_image itself",
    "/v1/responses/{response_id}/cancel": "no body",
    # Pooling models only: validation refuses a pooling engine (validation.GENERATION_ONLY).
    "/v1/embeddings": "pooling",
    "/pooling": "pooling",
    "/classify": "pooling",
    "/score": "pooling",
    "/v1/score": "pooling",
    "/rerank": "pooling",
    "/v1/rerank": "pooling",
    "/v2/embed": "pooling",
    "/v2/rerank": "pooling",
    # The engine's control: no request content.
    **dict.fromkeys(
        [
            "/abort_requests",
            "/inference/v1/abort_requests",
            "/checkpoint/prepare",
            "/checkpoint/restore",
            "/collective_rpc",
            "/fault_tolerance/apply",
            "/v1/fault_tolerance/apply",
            "/pause",
            "/resume",
            "/sleep",
            "/wake_up",
            "/release_kv_cache_memory",
            "/reset_encoder_cache",
            "/reset_mm_cache",
            "/reset_prefix_cache",
            "/start_profile",
            "/stop_profile",
            "/init_weight_transfer_engine",
            "/shutdown_weight_transfer_engine",
            "/start_weight_update",
            "/start_draft_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/update_weight_version",
            "/weight_checker",
            "/scale_elastic_ep",
            "/is_scaling_elastic_ep",
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
            "/ping",
        ],
        "control",
    ),
}


def test_every_post_route_of_vllm_is_primed_refused_or_runs_no_encoder(vllm_parser: VllmParser):
    known = set(core.PRIMED_ROUTES) | set(core.REFUSED_ROUTES) | set(NO_ENCODER_ROUTES)
    routes = vllm_parser.post_routes()
    assert routes - known == set(), (
        f"vLLM {vllm_parser.version} has POST routes the EPD proxy does not know: can they carry media into a "
        "generation? Prime them (core.PRIMED_ROUTES), refuse them (core.REFUSED_ROUTES) or list them here"
    )
    assert {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/invocations"} <= routes  # it reads them


@pytest.mark.parametrize("path", sorted(core.REFUSED_ROUTES))
def test_refused_routes_are_vllms(vllm_parser: VllmParser, path: str):
    assert path in vllm_parser.post_routes()


@pytest.mark.parametrize("path", sorted(core.KEYED_ROUTES))
def test_keyed_routes_are_vllms_renders(vllm_parser: VllmParser, path: str):
    assert path in vllm_parser.post_routes() and path in NO_ENCODER_ROUTES
