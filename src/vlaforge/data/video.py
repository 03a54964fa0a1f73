"""MP4 video I/O on PyAV: an appending H.264 writer whose episodes start on keyframes, and a decoder of
frame ranges by timestamp. Used by the LeRobot dataset reader/writer and by evaluation videos."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np

from vlaforge.errors import VlaforgeError


class VideoWriter:
    """One mp4 that many episodes are appended to; each episode starts on a keyframe (cheap seeks)."""

    def __init__(self, path: Path, fps: int, size: tuple[int, int], codec: str = "libx264", crf: int = 18):
        """size: (height, width), both even."""
        import av

        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.frames, self.bytes = path, 0, 0
        self.container = av.open(str(path), "w", format="mp4")
        self.stream = self.container.add_stream(codec, rate=fps)
        self.stream.height, self.stream.width = size
        self.stream.pix_fmt = "yuv420p"
        # NOTE: zerolatency: no lookahead or B-frames, so each episode's packets are written when it ends
        # (its size is known for file roll-over) and frames decode in presentation order.
        self.stream.options = ({"crf": str(crf), "preset": "veryfast", "tune": "zerolatency"} if codec == "libx264"
                               else {"crf": str(crf)})
        self.fps = fps

    def add(self, frames: np.ndarray) -> tuple[float, float]:
        """Encode (T, H, W, 3) uint8; returns the episode's (from_timestamp, to_timestamp)."""
        import av

        start = self.frames
        for i, img in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = start + i
            if i == 0:
                frame.pict_type = av.video.frame.PictureType.I
            for packet in self.stream.encode(frame):
                self.bytes += packet.size
                self.container.mux(packet)
        self.frames += len(frames)
        return start / self.fps, self.frames / self.fps

    def size_mb(self) -> float:
        return self.bytes / 2**20

    def close(self) -> None:
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()


def decode_frames(path: Path, from_timestamp: float, count: int, fps: float) -> np.ndarray:
    """Decode `count` frames starting at `from_timestamp` (seconds) from an mp4.

    Raises:
        VlaforgeError: the file is missing, unreadable, or ends before `count` frames.
    """
    import av

    if not path.is_file():
        raise VlaforgeError(f"video file {path} is missing; the dataset is incomplete - regenerate it")
    frames = []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            tb = stream.time_base
            if from_timestamp > 0:
                container.seek(int(Fraction(from_timestamp).limit_denominator(1_000_000) / tb), stream=stream,
                               backward=True)
            first = round(from_timestamp * fps)
            for frame in container.decode(stream):
                idx = round(float(frame.pts * tb) * fps)
                if idx < first:
                    continue
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) == count:
                    break
    except av.error.FFmpegError as exc:
        raise VlaforgeError(f"video file {path} cannot be decoded ({exc}); it is truncated or corrupt - "
                            "regenerate the dataset") from None
    if len(frames) < count:
        raise VlaforgeError(f"video file {path} ends after {len(frames)} of {count} frames of an episode starting at "
                            f"{from_timestamp:.3f}s; it is truncated - regenerate the dataset")
    return np.stack(frames)
