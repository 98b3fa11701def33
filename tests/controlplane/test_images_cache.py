"""The node's image cache ($EPD_CACHE/images), which every clone and worktree shares."""

from __future__ import annotations

import os

from epd_dev.images import build as images


def keys_built(builder: images.Builder, name: str, count: int) -> list[str]:
    """`count` builds of `name` under different keys, the oldest first (their folders' mtimes)."""
    folders = []
    for i in range(count):
        folder = builder.root / f"{name}-{i:012x}"
        folder.mkdir(parents=True)
        (folder / images.MARKER).write_text("{}")
        os.utime(folder, (1_000_000 + i, 1_000_000 + i))
        folders.append(folder.name)
    return folders


def test_a_small_images_recent_builds_of_other_clones_are_kept_and_the_oldest_go(tmp_path):
    builder = images.Builder(root=tmp_path)
    built = keys_built(builder, "epd-operator", 7)
    builder.prune("epd-operator", tmp_path / built[-1])
    left = sorted(p.name for p in tmp_path.glob("epd-operator-*"))
    assert left == sorted(built[-1 - images.OTHER_KEYS_KEPT :])


def test_a_big_images_other_builds_go_before_a_build_as_it_needs_their_space(tmp_path):
    builder = images.Builder(root=tmp_path)
    built = keys_built(builder, "vllm-cpu", 3)
    assert "vllm-cpu" in images.BUILD_SPACE
    builder.prune("vllm-cpu", tmp_path / built[-1])
    assert sorted(p.name for p in tmp_path.glob("vllm-cpu-*")) == [built[-1]]
    assert (tmp_path / built[-1]).is_dir()  # the one being built stays
