"""Media files for tests that need real encoded bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def make_video(path: Path, frames: int, fps: float = 10.0, size: tuple[int, int] = (64, 48)) -> bytes:
    """An MPEG-4 Part 2 video (the encoder every opencv-python wheel has): frame i is gray level
    (4 * i) % 256 with a white square moving one pixel per frame."""
    cv2 = pytest.importorskip("cv2", reason="video needs opencv-python")
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
    if not writer.isOpened():
        pytest.skip("this OpenCV build has no mp4v encoder")
    width, height = size
    for i in range(frames):
        frame = np.full((height, width, 3), (4 * i) % 256, np.uint8)
        frame[8:16, i % (width - 8): i % (width - 8) + 8] = 255
        writer.write(frame)
    writer.release()
    return path.read_bytes()
