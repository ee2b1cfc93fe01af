"""worker/generation/vision_inputs.py: the prompt cache's keys of a prompt with images, and the position ids that
cross a cut."""

from __future__ import annotations

import mlx.core as mx

from mlxpipe.protocol.request import Image
from mlxpipe.worker.generation import vision_inputs

PAD = 9
A, B = Image("", "a" * 64), Image("", "b" * 64)


def test_each_images_placeholders_are_keyed_by_its_hash() -> None:
    tokens = [1, 2, PAD, PAD, 3, PAD, 4]
    key = vision_inputs.cache_key(tokens, [A, B], PAD)
    assert key[:2] == [1, 2] and key[4] == 3 and key[6] == 4
    assert key[2] == key[3] != key[5] and key[2] < 0 and key[5] < 0
    assert vision_inputs.cache_key(tokens, [A, B], PAD) == key  # the same pictures: the same key
    assert vision_inputs.cache_key(tokens, [B, A], PAD) != key  # another picture in a place: another key
    assert vision_inputs.cache_key(tokens, [A, A], PAD)[5] == key[2]


def test_runs_that_are_not_one_per_image_share_one_mark() -> None:
    key = vision_inputs.cache_key([PAD, 5, PAD, 5, PAD], [A], PAD)  # one image broken into rows (Pixtral)
    assert key[0] == key[2] == key[4] < 0 and key[1] == key[3] == 5


def test_image_token_of_each_family() -> None:
    assert vision_inputs.image_token_of({"image_token_id": 5}) == 5
    assert vision_inputs.image_token_of({"image_token_index": 6}) == 6
    assert vision_inputs.image_token_of({"media_placeholder_token_id": 7}) == 7
    assert vision_inputs.image_token_of({}) is None


def test_positions_go_on_after_the_prompt_by_its_delta() -> None:
    positions = mx.array([[[0, 1, 1, 2]], [[0, 1, 2, 2]], [[0, 1, 1, 2]]], mx.int32)  # (3, 1, 4)
    prompt = vision_inputs.PromptFeatures(mx.zeros((1, 4, 2)), positions, delta=-1)
    assert vision_inputs.positions_of(prompt, 0, 4).tolist() == positions.tolist()
    after = vision_inputs.positions_of(prompt, 3, 3)  # the prompt's last token, then two replies: 4 + delta, 5 + delta
    assert after.tolist() == [[[2, 3, 4]], [[2, 3, 4]], [[2, 3, 4]]]


def test_positions_travel_packed_with_the_hidden_state() -> None:
    hidden = mx.random.normal((2, 3, 8)).astype(mx.float16)
    positions = mx.arange(18, dtype=mx.int32).reshape(3, 2, 3)
    message = vision_inputs.pack_positions(hidden, positions)
    assert message.dtype == mx.uint8
    back, ids = vision_inputs.unpack_positions(message, hidden.shape, hidden.dtype)
    assert mx.array_equal(back, hidden).item() and ids.tolist() == positions.tolist()


def test_deepstack_features_follow_each_rows_window() -> None:
    """A micro-batch's deepstack share: each row's image tokens inside its window, their features row after row,
    as mlx-vlm's language model takes them; nothing where no row reads an image token."""
    layers = [mx.arange(5 * 2, dtype=mx.float32).reshape(5, 2) + 100 * k for k in range(2)]  # 5 image tokens
    prompt = vision_inputs.PromptFeatures(mx.zeros((1, 12, 2)), None, 0, visual=[2, 3, 4, 7, 8], deepstack=layers)
    first = vision_inputs.deepstack_inputs([(prompt, 0)], 4)  # a prefill chunk: tokens 0-3 hold images 0 and 1
    assert first["visual_pos_masks"].tolist() == [[False, False, True, True]]
    assert [layer.tolist() for layer in first["deepstack_visual_embeds"]] == [
        layers[k][:2].tolist() for k in range(2)]
    rows = [(prompt, 4), (None, 0), (prompt, 7)]  # tokens 4-7 of it, a text-only row, tokens 7-10 of it
    both = vision_inputs.deepstack_inputs(rows, 4)
    assert both["visual_pos_masks"].tolist() == [[True, False, False, True], [False] * 4, [True, True, False, False]]
    assert both["deepstack_visual_embeds"][1].tolist() == layers[1][[2, 3, 3, 4]].tolist()
    assert vision_inputs.deepstack_inputs([(prompt, 9)], 1) == {}  # past the images: the reply's tokens
