"""Black-box HTTP conformance with vLLM 0.32's pooling server: ``/v1/embeddings`` and the related routes.

Every case runs against three targets, the ids reading ``test_x[vllm]``, ``test_x[embedder-local]`` and
``test_x[embedder-vllm]``: the real vLLM server (the session ``vllm_server``: the tiny Qwen3, last pooling,
``--max-model-len 512``), and our embedder with its local backend and with its vllm backend, both serving
the same tiny Qwen3 under vLLM's served name with ``CLM_EMBEDDER_ENCODER_MAX_TOKENS=512``. The ``vllm`` target
passing proves that a case states vLLM's real behaviour; the embedder targets must then match it.

The properties are vLLM's own tests rewritten without model constants (the "P" numbers of the issue-21
research note, §5): expected token counts come from the model's HF tokenizer, expected vectors from the
target itself. Exact messages are asserted where vLLM's tests assert them or the 0.32 source fixes them.

Out of scope: chunked long-text processing (P24, a server flag), Matryoshka ``dimensions`` (P23, the tiny
Qwen3 is not Matryoshka; P22 checks that ``dimensions`` is refused) and ``--api-key`` (tested elsewhere).
Chat (P10/P11) follows the model's tokenizer: with a chat template (the tiny Qwen3 has a ChatML one since
its builder version 3) a chat must embed as its rendered text; without one, every chat form must be vLLM's
no-template 400. Both branches were checked against vLLM 0.32.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import openai
import pytest

from support.embeddings_conformance import (
    ANY, BAD_SALT, EMBED_DTYPES, ENDIANNESS, MAX_MODEL_LEN, NO_TEMPLATE, OVER_LONG_CHARS, OVER_LONG_TOKENS, TARGETS,
    TOO_BIG_TRUNCATION, Target, assert_close, assert_cosine_close, assert_error, decode_base64, decode_binary,
    start_embedder_target, validation_error, vectors_of,
)

pytestmark = pytest.mark.vllm

TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs."
TEXTS = ["Hello my name is", "An alert fired for impossible travel: user j.doe signed in from Germany and Brazil."]
LONG = "alert " * 600  # well over MAX_MODEL_LEN tokens, but under the character pre-check's bound
MESSAGES = [{"role": "user", "content": "The cat sat on the mat."},
            {"role": "assistant", "content": "A feline was resting on a rug."},
            {"role": "user", "content": "Stars twinkle brightly in the night sky."}]


@pytest.fixture(scope="module")
def served_model(tiny_qwen3_dir) -> str:
    """vllm_server passes ``--model <resolved dir>`` and no ``--served-model-name``: that path is the name."""
    return str(Path(tiny_qwen3_dir).resolve())


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_dir, local_files_only=True)


@pytest.fixture(scope="module", params=TARGETS)
def target(request, tiny_qwen3_dir, served_model, tmp_path_factory):
    if request.param == "vllm":
        target = Target("vllm", request.getfixturevalue("vllm_server").base_url, served_model)
        yield target
        target.close()
        return
    vllm_url = request.getfixturevalue("vllm_server").base_url if request.param != "embedder-local" else None
    service = start_embedder_target(tmp_path_factory.mktemp(request.param), tiny_qwen3_dir, served_model, vllm_url,
                                    hub_name=request.param == "embedder-vllm-hub")
    target = Target(request.param, service.url, served_model)
    try:
        yield target
    finally:
        target.close()
        service.stop()


def ids_of(tokenizer, text: str, **kwargs) -> list[int]:
    return tokenizer(text, **kwargs)["input_ids"]


def test_models_list(target):
    """P1 (embed/test_online.py::test_basic): /v1/models names the served model; the OpenAI client agrees."""
    body = target.get("/v1/models").json()
    card = body["data"][0]
    assert (body["object"], card["id"], card["object"], card["max_model_len"]) == ("list", target.model, "model",
                                                                                   MAX_MODEL_LEN)
    client = openai.OpenAI(base_url=f"{target.url}/v1", api_key="unused", max_retries=0)
    assert [model.id for model in client.models.list().data][0] == target.model


def test_tokenize_matches_the_hf_tokenizer(target, tokenizer):
    """P2 (embed/test_online.py::test_basic): /tokenize gives the HF tokenizer's ids, special tokens included."""
    body = target.post("/tokenize", {"model": target.model, "prompt": TEXT}).json()
    assert body["tokens"] == ids_of(tokenizer, TEXT)
    assert (body["count"], body["max_model_len"]) == (len(body["tokens"]), MAX_MODEL_LEN)
    plain = target.post("/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["tokens"] == ids_of(tokenizer, TEXT, add_special_tokens=False)


def test_text_input_shape_and_usage(target, tokenizer):
    """P3/P6 (embed/test_online.py::test_completion_request, test_usage_policy.py): one normalised vector,
    vLLM's key order, usage = the prompt's tokens, id "embd-" + 16 hex, model = the served name."""
    body = target.embed_ok(model=target.model, input=TEXT)
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert re.fullmatch(r"embd-[0-9a-f]{16}", body["id"]), body["id"]
    assert (body["object"], body["model"], type(body["created"])) == ("list", target.model, int)
    assert [(list(item), item["index"], item["object"]) for item in body["data"]] == [
        (["index", "object", "embedding"], 0, "embedding")]
    n = len(ids_of(tokenizer, TEXT))
    assert list(body["usage"].items()) == [("prompt_tokens", n), ("total_tokens", n), ("completion_tokens", 0),
                                           ("prompt_tokens_details", None), ("completion_tokens_details", None)]
    np.testing.assert_allclose(np.linalg.norm(vectors_of(body)), 1.0, atol=1e-3)


def test_token_id_input_is_the_texts_vector(target, tokenizer):
    """P4 (embed/test_online.py::test_completion_request): input = tok(text) gives the text's vector and usage."""
    ids = ids_of(tokenizer, TEXT)
    text, tokens = target.embed_ok(input=TEXT), target.embed_ok(input=ids)
    assert tokens["usage"]["prompt_tokens"] == tokens["usage"]["total_tokens"] == len(ids)
    assert_close(vectors_of(tokens), vectors_of(text))


def test_batches_count_every_input(target, tokenizer):
    """P5/P6 (test_completion_request_batched, old openai/test_embedding.py, test_usage_policy.py): every
    input counts, duplicates and repeated requests included (no cache discount), in input order."""
    n, texts = len(ids_of(tokenizer, TEXT)), [TEXT] * 4
    for batch in (texts, [ids_of(tokenizer, TEXT)] * 4):
        body = target.embed_ok(input=batch)
        assert len(body["data"]) == 4 and body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 4 * n
        assert_close(vectors_of(body), np.repeat(vectors_of(body)[:1], 4, axis=0))
    lists = [[4, 5, 7, 9, 20], [15, 29, 499], [24] * 5, [25, 32, 64, 77]]
    assert target.embed_ok(input=lists)["usage"]["prompt_tokens"] == 17
    mixed = ["Hello", "World", "Hello", TEXT]
    first, second = target.embed_ok(input=mixed), target.embed_ok(input=mixed)
    expected = sum(len(ids_of(tokenizer, text)) for text in mixed)
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == expected
    vectors = vectors_of(second)
    assert_close(vectors[0], vectors[2])
    assert not np.allclose(vectors[0], vectors[1], atol=1e-2)
    assert_close(vectors, vectors_of(first))


def test_truncate_prompt_tokens(target, tokenizer):
    """P7 (embed/test_online.py::test_truncate_prompt_tokens, basic/test_truncation.py::test_smaller_truncation_size):
    N=10 keeps 10 tokens: text as HF truncation=True/max_length=10 (special tokens kept), token ids sliced,
    truncation_side left keeps the last 10; padding max_length pads to max_model_len (pads count)."""
    ids = ids_of(tokenizer, TEXT)
    assert len(ids) > 10
    for data, tokens in ((TEXT, ids_of(tokenizer, TEXT, truncation=True, max_length=10)), (ids, ids[:10])):
        body = target.embed_ok(input=data, truncate_prompt_tokens=10)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 10
        assert_close(vectors_of(body), target.vectors(input=tokens))
    left = target.embed_ok(input=ids, truncate_prompt_tokens=10, truncation_side="left")
    assert left["usage"]["prompt_tokens"] == 10
    assert_close(vectors_of(left), target.vectors(input=ids[-10:]))
    assert target.embed_ok(input=TEXT, padding="max_length")["usage"]["prompt_tokens"] == MAX_MODEL_LEN


def test_truncate_prompt_tokens_above_max_model_len(target):
    """P8 (basic/test_truncation.py::test_bigger_truncation_size, exact message; 8193 from test_online.py);
    below -1 is a validation error (base/protocol.py: Field(ge=-1))."""
    for value in (MAX_MODEL_LEN + 1, 8193):
        assert_error(target.embed(input=TEXT, truncate_prompt_tokens=value), 400, "BadRequestError",
                     message=TOO_BIG_TRUNCATION, param=None)
    validation_error(target.embed(input=TEXT, truncate_prompt_tokens=-2), "body.truncate_prompt_tokens",
                     "greater_than_equal", "Input should be greater than or equal to -1")


def test_truncate_minus_one_means_max_model_len(target):
    """P9 (basic/test_truncation.py::test_max_truncation_size): -1 cuts an over-long text to max_model_len."""
    body = target.embed_ok(input=LONG, truncate_prompt_tokens=-1)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == MAX_MODEL_LEN


def test_over_long_input_is_refused(target, tokenizer):
    """P9b (renderers/params.py _token_len_check/_text_len_check, untested upstream): without truncation an
    over-long text or token list is a 400, never silently cut; text is tokenized to L+1 ("at least")."""
    L = MAX_MODEL_LEN
    assert_error(target.embed(input=LONG), 400, "BadRequestError", param="input_tokens",
                 message=OVER_LONG_TOKENS.format(L=L, n=f"at least {L + 1}", v=L + 1))
    assert_error(target.embed(input=[5] * 600), 400, "BadRequestError", param="input_tokens",
                 message=OVER_LONG_TOKENS.format(L=L, n=600, v=600))
    bound = L * max(len(token) for token in tokenizer.get_vocab())  # vLLM's character pre-check bound
    assert_error(target.embed(input="a" * (bound + 1)), 400, "BadRequestError", param="input_text",
                 message=OVER_LONG_CHARS.format(L=L, c=bound + 1, bound=bound))


def test_chat_input(target, tokenizer):
    """P10/P11 (embed/test_online.py::test_chat_request): a chat embeds as its rendered template text sent with
    add_special_tokens false; usage follows /tokenize for add_generation_prompt, continue_final_message and
    add_special_tokens; the batch and `input` forms agree. Without a chat template every chat form, and
    /tokenize of a chat, is vLLM's 400 (renderers/hf.py safe_apply_chat_template)."""
    rendered = target.post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    forms = [{"messages": MESSAGES}, {"messages": [MESSAGES, MESSAGES[:1]]}, {"input": MESSAGES},
             {"input": [MESSAGES, MESSAGES[:1]]}]
    if tokenizer.chat_template is None:
        assert_error(rendered, 400, "BadRequestError", message=NO_TEMPLATE, param=None)
        for body in forms:
            assert_error(target.embed(**body), 400, "BadRequestError", message=NO_TEMPLATE, param=None)
        return
    assert rendered.status_code == 200, rendered.text
    chat = target.embed_ok(messages=MESSAGES)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    plain = target.embed_ok(input=text, add_special_tokens=False)
    assert_close(vectors_of(chat), vectors_of(plain))
    assert (chat["usage"], chat["model"], chat["object"]) == (plain["usage"], plain["model"], plain["object"])
    assert chat["created"] <= plain["created"]
    count = rendered.json()["count"]
    assert chat["usage"]["prompt_tokens"] == count
    for flags in ({"add_generation_prompt": True}, {"continue_final_message": True}):
        tokens = target.post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False, **flags}).json()
        assert target.embed_ok(messages=MESSAGES, **flags)["usage"]["prompt_tokens"] == tokens["count"]
    special = len(ids_of(tokenizer, "x")) - len(ids_of(tokenizer, "x", add_special_tokens=False))
    assert target.embed_ok(messages=MESSAGES, add_special_tokens=True)["usage"]["prompt_tokens"] == count + special
    batches = [vectors_of(target.embed_ok(**body)) for body in forms[1:]]
    assert_close(batches[0][0], vectors_of(chat)[0])
    assert_close(batches[1], vectors_of(chat))
    assert_close(batches[2], batches[0])


def test_chat_option_errors(target):
    """P12 (embed/test_online.py::test_chat_request): continue_final_message with add_generation_prompt is a
    400 (base/protocol.py check_generation_prompt); a per-request chat_template needs
    --trust-request-chat-template (base/io_processor.py _validate_chat_template)."""
    assert_error(target.embed(messages=MESSAGES, add_generation_prompt=True, continue_final_message=True), 400,
                 "BadRequestError", param=None,
                 message="Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    assert_error(target.embed(messages=MESSAGES, chat_template="{{ messages }}"), 400, "BadRequestError", param=None,
                 message="Chat template is passed with request, but --trust-request-chat-template is not set. "
                         "Refused request with untrusted chat template.")


def test_invocations_answers_like_embeddings(target):
    """P13 (embed/test_online.py::test_invocations_completion_request / _chat_request): /invocations with an
    embeddings body answers as /v1/embeddings: same keys, same item keys, close vectors (or the same error)."""
    for body in ({"model": target.model, "input": TEXT, "encoding_format": "float"},
                 {"model": target.model, "messages": MESSAGES, "encoding_format": "float"}):
        direct, invoked = target.post("/v1/embeddings", body), target.post("/invocations", body)
        assert invoked.status_code == direct.status_code, invoked.text
        if direct.status_code != 200:
            assert invoked.json() == direct.json()
            continue
        direct, invoked = direct.json(), invoked.json()
        assert list(invoked) == list(direct)
        assert [list(item) for item in invoked["data"]] == [list(item) for item in direct["data"]]
        assert_close(vectors_of(invoked), vectors_of(direct))


def test_base64_is_the_float_result(target):
    """P14 (embed/test_online.py::test_base64_embedding): base64 decodes (little-endian float32) to the floats."""
    floats = target.vectors(input=TEXTS, encoding_format="float")
    body = target.embed_ok(input=TEXTS, encoding_format="base64")
    assert all(isinstance(item["embedding"], str) for item in body["data"])
    assert_close(decode_base64(body), floats, atol=1e-6)


def test_base64_embed_dtypes_and_endianness(target):
    """P15 (embed/test_online.py::test_base64_embed_dtype_and_endianness): every embed_dtype x endianness
    decodes (binary2tensor) close to the floats, with the dtype's width; `float` output ignores embed_dtype."""
    floats = target.vectors(input=TEXTS)
    for embed_dtype in EMBED_DTYPES:
        for endianness in ENDIANNESS:
            body = target.embed_ok(input=TEXTS, encoding_format="base64", embed_dtype=embed_dtype,
                                   endianness=endianness)
            decoded = decode_base64(body, embed_dtype, endianness)
            assert decoded.shape == floats.shape, (embed_dtype, endianness, decoded.shape)
            assert_cosine_close(decoded, floats)
        ignored = target.vectors(input=TEXTS, encoding_format="float", embed_dtype=embed_dtype, endianness="big")
        assert_close(ignored, floats, atol=1e-6)


def test_bytes_encoding(target):
    """P16 (embed/test_online.py::test_bytes_embed_dtype_and_endianness): a `metadata` header whose items slice
    the octet-stream body; every embed_dtype x endianness decodes close to the floats."""
    reference = target.embed_ok(input=TEXTS)
    floats, usage = vectors_of(reference), reference["usage"]
    size = floats.shape[1]
    for embed_dtype in EMBED_DTYPES:
        for endianness in ENDIANNESS:
            response = target.embed(input=TEXTS, encoding_format="bytes", embed_dtype=embed_dtype,
                                    endianness=endianness)
            assert response.status_code == 200, response.text
            assert response.headers["content-type"] == "application/octet-stream"
            metadata = json.loads(response.headers["metadata"])
            assert metadata["model"] == target.model and metadata["id"].startswith("embd-")
            assert metadata["usage"] == {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]}
            items, nbytes = metadata["data"], size * EMBED_DTYPES[embed_dtype].itemsize
            assert items == [{"index": i, "embed_dtype": embed_dtype, "endianness": endianness, "start": i * nbytes,
                              "end": (i + 1) * nbytes, "shape": [size]} for i in range(len(TEXTS))]
            assert len(response.content) == len(TEXTS) * nbytes
            decoded = np.stack([decode_binary(response.content[item["start"]:item["end"]], embed_dtype, endianness)
                                for item in items])
            assert_cosine_close(decoded, floats)


def test_bytes_only_encoding(target):
    """P17 (embed/test_online.py::test_bytes_only_embed_dtype_and_endianness): no `metadata` header; the body is
    N*dim*itemsize bytes, sliced at computed offsets (build_metadata_items)."""
    floats = target.vectors(input=TEXTS)
    n, dim = floats.shape
    for embed_dtype, dtype in EMBED_DTYPES.items():
        for endianness in ENDIANNESS:
            response = target.embed(input=TEXTS, encoding_format="bytes_only", embed_dtype=embed_dtype,
                                    endianness=endianness)
            assert response.status_code == 200, response.text
            assert "metadata" not in response.headers
            assert len(response.content) == n * dim * dtype.itemsize
            assert_cosine_close(decode_binary(response.content, embed_dtype, endianness).reshape(n, dim), floats)


def test_bad_encoding_values(target):
    """P18 (embed/test_online.py::test_params_not_supported): a bad encoding_format/embed_dtype/endianness is a
    400 validation error naming literal_error and the bad value (the old "is not supported." is obsolete)."""
    for name in ("encoding_format", "embed_dtype", "endianness"):
        body = {"input": TEXT, "encoding_format": "base64", name: f"bad_{name}"}
        validation_error(target.post("/v1/embeddings", body), f"body.{name}", "literal_error", f"bad_{name}")


def test_use_activation_and_removed_normalize(target):
    """P19 (embed/test_online.py::test_use_activation; base/protocol.py reject_removed_pooling_parameters):
    default ~ true, true != false, true ~ normalize(false); any `normalize` key is a 400."""
    default, on, off = (target.vectors(input=TEXTS, use_activation=value) for value in (None, True, False))
    assert_close(default, on, atol=1e-2)
    assert not np.allclose(on, off, atol=1e-2)
    assert_close(on, off / np.linalg.norm(off, axis=1, keepdims=True), atol=1e-2)
    for value in (True, None):
        assert_error(target.embed(input=TEXT, normalize=value), 400, "BadRequestError", param="normalize",
                     message="Parameter `normalize` was removed; use `use_activation` instead. (parameter=normalize)")


def test_pooling_embed_task(target, tokenizer):
    """P20 (embed/test_online.py::test_pooling_embed): /pooling with task embed (or none) gives the embedding."""
    vector = target.vectors(input=TEXT)
    for task in ({"task": "embed"}, {}):
        response = target.post("/pooling", {"model": target.model, "input": TEXT, "encoding_format": "float", **task})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["id"].startswith("pooling-") and body["model"] == target.model
        assert [(item["index"], item["object"]) for item in body["data"]] == [(0, "pooling")]
        assert_close(vectors_of(body, key="data"), vector)
        assert body["usage"]["prompt_tokens"] == len(ids_of(tokenizer, TEXT))


def test_pooling_unsupported_tasks(target):
    """P21 (embed/test_online.py::test_pooling_not_supported, test_pooling_token_embed; installed
    pooling/serving.py _verify_pooling_task, tasks.py): other tasks, removed tasks and dimensions are 400s."""
    def pool(**extra):
        return target.post("/pooling", {"input": "test", "encoding_format": "float", **extra})

    for task in ("classify", "token_classify"):
        assert_error(pool(task=task), 400, "BadRequestError", startswith=f"Unsupported task: {task!r}", param="task")
    assert_error(pool(task="token_embed"), 400, "BadRequestError", param="task",
                 message="Try switching the model's pooling_task via --pooler-config.task token_embed. (parameter=task)")
    assert_error(pool(task="plugin"), 400, "BadRequestError", startswith="No IOProcessor plugin installed.", param="task")
    removed = {"score": "`score` task was removed; use `classify` instead. (parameter=task)",
               "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead. (parameter=task)"}
    for task, message in removed.items():
        assert_error(pool(task=task), 400, "BadRequestError", message=message, param="task")
        assert_error(target.embed(input="test", task=task), 400, "BadRequestError", message=message, param="task")
    assert_error(pool(dimensions=4), 400, "BadRequestError", param="dimensions",
                 message="dimensions is currently not supported (parameter=dimensions)")


def test_dimensions_on_a_non_matryoshka_model(target):
    """P22 (embed/test_online_dimensions.py; pooling_params.py verify): dimensions unset works; any value,
    even -1 or the native size, is a 400."""
    dim = target.vectors(input=TEXT, dimensions=None).shape[1]
    for value in (-1, 16, dim):
        assert_error(target.embed(input=TEXT, dimensions=value), 400, "BadRequestError", param=None, contains=(
            f"does not support Matryoshka embeddings; dimensions must be unset (received dimensions={value}).",))


def test_cache_salt(target):
    """P25 (test_cache_salt_validation.py; generate/base/protocol.py validate_cache_salt): "" and bad salts are
    400 with param cache_salt; a good salt or none is 200 and leaves the vector unchanged."""
    assert_error(target.embed(input=TEXT, cache_salt=""), 400, "BadRequestError", param="cache_salt",
                 message="Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)")
    for salt in ("a/b", "x" * 129):
        assert_error(target.embed(input=TEXT, cache_salt=salt), 400, "BadRequestError", param="cache_salt",
                     message=BAD_SALT)
    assert_close(target.vectors(input=TEXT, cache_salt="tenant-a"), target.vectors(input=TEXT))


def test_model_names(target):
    """Extra (engine/serving.py _check_model; openai/models/serving.py model_name): an unknown model is 404;
    none, "" or the served name are served, and the response names the served model."""
    assert_error(target.embed(input=TEXT, model="no-such-model"), 404, "NotFoundError", param=None,
                 message="The model `no-such-model` does not exist.")
    for model in ({}, {"model": ""}, {"model": target.model}):
        assert target.embed_ok(input=TEXT, **model)["model"] == target.model


def test_bad_inputs(target):
    """Extra (base/serving.py _preprocessing, v1/engine/input_processor.py): [] needs a prompt, [[]] is an empty
    prompt, an out-of-vocabulary id is refused."""
    assert_error(target.embed(input=[]), 400, "BadRequestError", param=None, message="You must pass at least one prompt")
    assert_error(target.embed(input=[[]]), 400, "BadRequestError", param=None,
                 message="The decoder prompt cannot be empty")
    assert_error(target.embed(input=[5, 10**6]), 400, "BadRequestError", param=None,
                 message="Token id 1000000 is out of vocabulary")
    validation_error(target.embed(input=3.5), "body.input")


def test_content_type_and_json(target):
    """Extra (serve/utils/api_utils.py validate_json_request; validation handler): a non-JSON content type and
    invalid JSON are 400 "Bad Request" (never 415/422)."""
    response = target.post("/v1/embeddings", content=b'{"input": "x"}', headers={"content-type": "text/plain"})
    error = validation_error(response, None)
    assert error["message"] == "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    response = target.post("/v1/embeddings", content=b'{"input": ', headers={"content-type": "application/json"})
    assert "json_invalid" in validation_error(response, ANY)["message"]


def test_unknown_keys_are_ignored(target):
    """Extra (serve/engine/protocol.py OpenAIBaseModel extra="allow"): unknown keys change nothing."""
    assert_close(target.vectors(input=TEXT, no_such_field=1, user="someone", priority=0), target.vectors(input=TEXT))


def test_version_health_ping(target):
    """Extra (instrumentator/basic.py, instrumentator/health.py, sagemaker/api_router.py): /version is
    {"version": str}; /health, GET /ping and POST /ping are 200."""
    body = target.get("/version").json()
    assert list(body) == ["version"] and isinstance(body["version"], str) and body["version"]
    for response in (target.get("/health"), target.get("/ping"), target.post("/ping")):
        assert response.status_code == 200, response.text


def test_request_id(target):
    """Extra (engine/serving.py _base_request_id): id = "embd-" + the X-Request-Id header, else request_id."""
    assert target.post("/v1/embeddings", {"input": TEXT}, headers={"X-Request-Id": "abc"}).json()["id"] == "embd-abc"
    assert target.embed_ok(input=TEXT, request_id="xyz")["id"] == "embd-xyz"
    both = target.post("/v1/embeddings", {"input": TEXT, "request_id": "xyz"}, headers={"X-Request-Id": "abc"})
    assert both.json()["id"] == "embd-abc"


def test_openai_python_sdk(target, tokenizer):
    """P14/P3/P4/P8 through the official OpenAI SDK: float, the default (base64, decoded by the SDK), token ids;
    a refused request raises BadRequestError."""
    client = openai.OpenAI(base_url=f"{target.url}/v1", api_key="unused", max_retries=0)
    floats = client.embeddings.create(model=target.model, input=TEXTS, encoding_format="float")
    default = client.embeddings.create(model=target.model, input=TEXTS)
    reference = np.array([item.embedding for item in floats.data], dtype=np.float32)
    assert [item.index for item in default.data] == [0, 1] and default.model == target.model
    assert_close(np.array([item.embedding for item in default.data], dtype=np.float32), reference, atol=1e-6)
    expected = sum(len(ids_of(tokenizer, text)) for text in TEXTS)
    assert floats.usage.prompt_tokens == default.usage.prompt_tokens == floats.usage.total_tokens == expected
    tokens = client.embeddings.create(model=target.model, input=[ids_of(tokenizer, t) for t in TEXTS],
                                      encoding_format="float")
    assert_close(np.array([item.embedding for item in tokens.data], dtype=np.float32), reference)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=target.model, input=TEXTS, extra_body={"truncate_prompt_tokens": 8193})
    assert refused.value.status_code == 400
