"""extras/datasets.py: a vision dataset (TRL's image columns, image content parts) is refused at
load, naming the row; the models are text-only."""

import json

import pytest

from nanogrpo.extras.datasets import load_dataset


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


TEXT = {"type": "text", "text": "What is in the picture?"}


@pytest.mark.parametrize(
    "row, said",
    [
        ({"prompt": "Describe it.", "image": "cat.png"}, "column 'image' holds images"),
        ({"prompt": "Describe it.", "images": [{"path": "a.png"}]}, "column 'images' holds"),
        (
            {"prompt": [{"role": "user", "content": [{"type": "image"}, TEXT]}]},
            "message 0 has an 'image' content part",
        ),
        (
            {"prompt": [{"role": "user", "content": [TEXT, {"type": "image_url", "url": "x"}]}]},
            "message 0 has an 'image_url' content part",
        ),
    ],
)
def test_rows_with_images_are_refused_at_load(tmp_path, row, said):
    plain = (
        {"prompt": "Describe a cat."}
        if isinstance(row["prompt"], str)
        else {"prompt": [{"role": "user", "content": "Describe a cat."}]}
    )
    path = write_jsonl(tmp_path / "vision.jsonl", [plain, row])
    with pytest.raises(ValueError, match=f"row 1: {said}.*text-only") as e:
        load_dataset(path)
    assert "\n" not in str(e.value)  # one line


def test_empty_image_columns_and_text_parts_load():
    rows = [
        {"prompt": [{"role": "user", "content": [TEXT]}], "image": None, "images": []},
    ]
    from nanogrpo.extras.datasets import check_text_only

    assert check_text_only(rows, "rows") is rows
