"""A chat request read for the engine (stages/api/chat.py): messages converted in order with
images as placeholders, images counted before any is decoded, sampling parameters mapped; and an
error's parameter name (stages/api/errors.py). No model."""

from __future__ import annotations

import pytest

from stages.api.chat import hf_messages, image_sources, read_images, sampling_params
from stages.api.images import open_image
from stages.api.errors import param_name
from tests.support.stage_api import LIMITS, data_url, image_part, png, raises_api_error, request

pytestmark = pytest.mark.unit


def test_messages_convert_in_order_with_images_as_placeholders():
    a, b, c = data_url(png(color=(1, 1, 1))), data_url(png(color=(2, 2, 2))), data_url(png(color=(3, 3, 3)))
    req = request(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [image_part(a), {"type": "text", "text": "and"}, image_part(b)]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "now"}, {"type": "image_url", "image_url": c}]},
    ])
    assert hf_messages(req) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "now"}, {"type": "image"}]},
    ]
    assert [param for _, param in image_sources(req)] == [
        "messages[1].content[0].image_url", "messages[1].content[2].image_url", "messages[3].content[1].image_url"]
    assert [open_image(im.data, LIMITS, im.param).getpixel((0, 0)) for im in read_images(req, LIMITS)] == [
        (1, 1, 1), (2, 2, 2), (3, 3, 3)]


def test_developer_is_the_system_role():
    """OpenAI's current name for the system role reaches the chat template as system."""
    req = request(messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "q"}])
    assert hf_messages(req) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]


def test_assistant_message_without_content_becomes_empty_text():
    req = request(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": None}])
    assert hf_messages(req)[1] == {"role": "assistant", "content": ""}


def test_images_are_counted_before_any_is_decoded():
    bad = "data:image/png;base64,@@@"  # would be a 400 invalid_base64 if it were decoded
    req = request(messages=[{"role": "user", "content": [image_part(bad)] * 2},
                            {"role": "user", "content": [image_part(bad)] * 2}])
    error = raises_api_error(read_images, req, LIMITS)
    assert (error.status, error.code, error.param) == (400, "too_many_images", "messages")
    assert "4 images" in error.message and "at most 3" in error.message


def test_sampling_params_mapping():
    p = sampling_params(request(), prompt_len=10, max_model_len=100, vocab_size=1000)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos) == (
        90, 1.0, 1.0, 0, None, (), False)
    p = sampling_params(request(max_tokens=5, max_completion_tokens=7, temperature=0, top_p=0.5, top_k=-1, seed=3,
                                stop="END", ignore_eos=True), prompt_len=10, max_model_len=100, vocab_size=1000)
    assert (p.max_tokens, p.greedy, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos) == (
        7, True, 0.5, 0, 3, ("END",), True)
    assert sampling_params(request(max_tokens=5, stop=["a", "b"], top_k=4), 10, 100, 1000).stop == ("a", "b")
    assert sampling_params(request(), 100, 100, 1000).max_tokens == 1  # engine refuses it later


def test_param_names_drop_union_tags():
    loc = ("body", "messages", 0, "content", "list[ContentPart]", 1, "image_url", "ImageURL", "url")
    assert param_name(loc) == "messages[0].content[1].image_url.url"
    assert param_name(("body", "stop", "str")) == "stop"
    assert param_name(("body",)) is None
