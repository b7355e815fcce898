"""Widths a config ties to another config's: a scaled copy keeps the tie, or the model it builds does not run."""

from __future__ import annotations


def tie_merged_width(out: dict, data: dict) -> None:
    """A projector fed the vision tower's patches merged ``merge_size x merge_size`` (MuseGlimmer's
    ``out_hidden_size``, 4 x the tower's width): the copy's width is the copy's tower's, merged alike."""
    vision, tiny = data.get("vision_config"), out.get("vision_config")
    if not isinstance(vision, dict) or not isinstance(tiny, dict) or not isinstance(data.get("out_hidden_size"), int):
        return
    merge = vision.get("merge_size")
    if isinstance(merge, int) and data["out_hidden_size"] == vision.get("hidden_size", 0) * merge * merge:
        out["out_hidden_size"] = tiny.get("hidden_size", vision["hidden_size"]) * merge * merge
