"""Header checks every backend runs before it decodes a single pixel.

`probe` validates the format and size from the image header (the
decompression-bomb guard) and says whether the bytes are a JPEG a GPU decoder
can take as is. Anything else (PNG, WebP, GIF, CMYK JPEG, a JPEG whose scan
data stops before its end marker) goes to the reference Pillow decoder, which
is also the one that names what is wrong with a corrupt file.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.processing.image import ImageDecodeError, ImageProcessorConfig, check_source_size, read_image_size

# Start-of-frame markers: C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_SOS, _EOI = 0xDA, b"\xff\xd9"
# Markers that stand alone, without a length field.
_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}
# GPU decoders take grey and YCbCr JPEGs. CMYK/YCCK need Pillow's colour
# conversion to match the reference, and a 3-component JPEG stored as plain RGB
# (Adobe transform 0, or component ids 'R','G','B') would come out with wrong
# colours from a decoder that assumes YCbCr.
_GPU_COMPONENTS = (1, 3)
_APP14 = 0xEE
_RGB_IDS = b"RGB"


@dataclass(frozen=True)
class ImageHeader:
    """What the header says: source size, the patch grid, and the decode route."""

    height: int
    width: int
    grid: tuple[int, int, int]  # (1, grid_h, grid_w) in patches
    resized: tuple[int, int]  # (height, width) the pixels are resized to
    gpu_jpeg: bool  # a complete grey/YCbCr JPEG: safe for nvJPEG / DALI decoders

    @property
    def source_size(self) -> tuple[int, int]:
        return self.height, self.width


def check_blobs(blobs: list[bytes]) -> None:
    """A non-bytes item is the caller's bug, not bad media: fail the whole call."""
    if not isinstance(blobs, list):
        raise TypeError(f"blobs must be a list of bytes, got {type(blobs).__name__}")
    for i, blob in enumerate(blobs):
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"blobs[{i}] must be bytes, got {type(blob).__name__}")


def probe_batch(blobs: list[bytes], cfg: ImageProcessorConfig) -> list[ImageHeader | ImageDecodeError]:
    """`probe` for each blob; a bad one yields its error in its slot."""
    check_blobs(blobs)
    slots: list[ImageHeader | ImageDecodeError] = []
    for blob in blobs:
        try:
            slots.append(probe(blob, cfg))
        except ImageDecodeError as exc:
            slots.append(exc)
    return slots


def probe(data: bytes, cfg: ImageProcessorConfig) -> ImageHeader:
    """Validate `data` from its header alone; raises ImageDecodeError."""
    height, width = read_image_size(data)
    grid = check_source_size(height, width, cfg)
    raw = data if isinstance(data, (bytes, bytearray)) else bytes(data)
    resized = (grid[1] * cfg.patch_size, grid[2] * cfg.patch_size)
    return ImageHeader(height, width, grid, resized, _is_gpu_jpeg(raw))


def _is_gpu_jpeg(data: bytes) -> bool:
    """Walk the JPEG segments to the first scan: the frame must be grey or
    YCbCr, and an end-of-image marker must follow the scan start.

    Why the end marker: a GPU decoder may hand back a partly grey image for a
    truncated file where the reference raises. Inside entropy-coded data 0xFF is
    always followed by 0x00 or a restart marker, so FFD9 there is the real end.
    """
    if data[:2] != b"\xff\xd8":
        return False
    pos, ycbcr_or_grey, size = 2, False, len(data)
    plain_rgb = False
    while pos + 4 <= size:
        if data[pos] != 0xFF:
            return False
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if length < 2:
            return False
        segment = data[pos + 4:pos + 2 + length]
        if marker in _SOF_MARKERS and len(segment) >= 6:
            components = segment[5]
            ycbcr_or_grey = components in _GPU_COMPONENTS
            plain_rgb |= components == 3 and segment[6:15:3] == _RGB_IDS
        elif marker == _APP14 and segment[:5] == b"Adobe" and len(segment) >= 12:
            plain_rgb |= segment[11] == 0  # transform 0: no colour transform
        elif marker == _SOS:
            return ycbcr_or_grey and not plain_rgb and data.find(_EOI, pos + 2 + length) >= 0
        pos += 2 + length
    return False
