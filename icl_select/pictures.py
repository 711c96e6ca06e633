"""Pictures: who a picture is (its pixels, whatever file, copy, link or PIL image carries them), and the caches that
decode each picture file once.

    pixel_digest(image) -> "3fa2..."      SHA-256 of the RGB pixels and size: one picture however it arrives
    picture_digest(path or PIL image)     the same, a file's decoded once per process (the digest kept by file key)
    picture_digests(paths, stats)         the same for many files, remembered in `stats` by size and time
    load_image(path) -> RGB image         decoded once while it stays in DECODED_IMAGES (and the file is unchanged)

Wherever the kit keeps a question's own picture out of its demonstrations (pools, the library), it compares pixel
digests, so a copy of a library picture, a link to it or the same picture opened with PIL is the same picture.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

from icl_select.files import DataError, atomic_write_text, read_json

IMAGE_KEY = "icl_select_picture"  # each loaded image's picture_key, in its .info: what its cached results are kept by


class ByteLRU:
    """A least-recently-used cache bounded by the bytes it holds (COCO images and their patches vary tenfold in size);
    the newest entry always stays. Thread-safe: a value is made outside the lock, and the first put wins."""

    def __init__(self, budget: int, sizeof: Callable[[object], int]):
        self.budget, self.sizeof = budget, sizeof
        self.entries: OrderedDict[object, tuple[object, int]] = OrderedDict()
        self.bytes = self.misses = 0
        self.lock = threading.Lock()

    def get(self, key, make: Callable[[], object]):
        if (value := self.lookup(key)) is not None:
            return value
        return self.put(key, make())

    def __contains__(self, key) -> bool:
        """Whether a value is held under `key` (its recency unchanged)."""
        with self.lock:
            return key in self.entries

    def lookup(self, key):
        """The value held under `key`, now the most recently used, or None."""
        with self.lock:
            if key not in self.entries:
                return None
            self.entries.move_to_end(key)
            return self.entries[key][0]

    def put(self, key, value):
        """Hold `value` under `key` as the most recently used, unless a value is held there already; returns the
        value held."""
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key][0]
            self.entries[key] = (value, self.sizeof(value))
            self.bytes += self.entries[key][1]
            self.misses += 1  # every value held was made once for it
            while self.bytes > self.budget and len(self.entries) > 1:
                self.bytes -= self.entries.popitem(last=False)[1][1]
            return value

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.bytes = 0


MIB = 2**20
DEFAULT_IMAGE_CACHE_MIB = 4096
# Decoded RGB images by picture_key, shared by every backend of the process (half of the image cache budget; an
# LVLMBackend sets it). A 640x480 COCO image is 0.9 MiB decoded.
DECODED_IMAGES = ByteLRU(DEFAULT_IMAGE_CACHE_MIB * MIB // 2, lambda img: img.width * img.height * 3)

PictureKey = tuple[str, int, int, int]
# The pixel digest of every picture file decoded in this process, by picture_key: a picture is decoded for its CLIP
# embedding, and its digest then costs nothing more.
PIXELS: dict[PictureKey, str] = {}


def picture_key(path: str) -> PictureKey:
    """What the picture caches know a file by: its path, size, modification time (ns) and inode, so that a file
    rewritten or replaced in place is read again, not served from a cache (as make and git tell changed files)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: image file not found") from None
    return path, st.st_size, st.st_mtime_ns, st.st_ino


def _decode(key: PictureKey) -> Image.Image:
    path = key[0]
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
            rgb.info[IMAGE_KEY] = key
            PIXELS[key] = pixel_digest(rgb)
            return rgb
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: image file not found") from None
    except (OSError, SyntaxError, ValueError) as e:  # PIL's errors for truncated or corrupt files
        raise ValueError(f"{path}: not a readable image ({e})") from None


def load_image(path: str) -> Image.Image:
    """The RGB image at `path`, decoded once while it stays in DECODED_IMAGES (and the file is unchanged) and shared:
    callers must not modify it."""
    key = picture_key(path)
    return DECODED_IMAGES.get(key, lambda: _decode(key))


def decode_ahead(paths: list[str], pool: ThreadPoolExecutor | None) -> None:
    """Decode the pictures of `paths` not in DECODED_IMAGES yet, in the pool's threads (PIL releases the GIL)."""
    if pool is None:
        return
    missing = [k for k in dict.fromkeys(map(picture_key, paths)) if k not in DECODED_IMAGES]
    if len(missing) < 2:
        return
    for key, image in zip(missing, pool.map(_decode, missing)):
        DECODED_IMAGES.put(key, image)


@functools.cache
def _header_pixels(key: PictureKey) -> int:
    try:
        with Image.open(key[0]) as img:
            return img.width * img.height
    except (OSError, SyntaxError, ValueError):
        return 0  # decoding it later says what is wrong


def picture_pixels(path: str) -> int:
    """Width x height of the picture at `path`, from its header alone (no decoding): a prompt's length key."""
    try:
        return _header_pixels(picture_key(path))
    except FileNotFoundError:
        return 0  # as above


def picture_id(image: str | Path | Image.Image) -> str | int:
    """What tells two pictures of clip_embed apart: a file's path, a PIL image's identity."""
    return id(image) if isinstance(image, Image.Image) else str(image)


def rgb(image: str | Path | Image.Image) -> Image.Image:
    """A picture given as a file (decoded through load_image's cache) or a PIL image, in RGB."""
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    return load_image(str(image))


def pixel_digest(image: Image.Image) -> str:
    """Who a picture is: SHA-256 (hex) of its size and RGB pixels. A file, its copy, a link to it and the PIL image
    decoded from it give the same digest; another encoding of other pixels (a re-saved JPEG) does not."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    return hashlib.sha256(f"{rgb.width}x{rgb.height}".encode() + rgb.tobytes()).hexdigest()


def picture_digest(image: str | Path | Image.Image) -> str:
    """`pixel_digest` of a picture given as a PIL image or a file (decoded once per process while it is unchanged)."""
    if isinstance(image, Image.Image):
        return pixel_digest(image)
    key = picture_key(str(image))
    if key not in PIXELS:
        _decode(key)
    return PIXELS[key]


def stamp(path: str) -> list[int]:
    """A file's size and modification time (ns): while they are unchanged its pixels are taken as unchanged."""
    return list(picture_key(path)[1:3])


# A real dataset folder's record of its pictures' files as it embedded them: not content (the items' pixel digests
# are), so not part of its data digest, but what tells its readers that no picture changed since, at a stat a file.
STAMPS = "picture_stamps.json"


def write_stamps(folder: Path, items: dict[str, list[dict]]) -> None:
    stamps = {it["image"]: stamp(it["image"]) for rows in items.values() for it in rows if "picture" in it}
    if stamps:
        atomic_write_text(folder / STAMPS, json.dumps(stamps) + "\n")


def check_pictures(folder: Path, items: dict[str, list[dict]]) -> None:
    """Refuse, in one line, pictures that changed since the dataset `folder` listing them was built: a file whose size
    or time moved from its stamp is decoded again and its pixels' digest compared with its item's "picture". A file
    touched but not changed is stamped anew, so that it is decoded once; one missing is left to the reader that shows
    it (a folder may be trained on where its pictures are not). A folder without stamps (the simulator's) lists none."""
    if not (folder / STAMPS).is_file():
        return
    stamps, moved = read_json(folder / STAMPS), {}
    stamps = stamps if isinstance(stamps, dict) else {}  # a damaged record only costs decoding them again
    digests = {it["image"]: it["picture"] for rows in items.values() for it in rows if "picture" in it}  # a file once
    for path, digest in digests.items():
        if not os.path.isfile(path) or (now := stamp(path)) == stamps.get(path):
            continue
        if picture_digest(path) != digest:
            raise ValueError(
                f"{path}: the picture changed since {folder} was built (other pixels); put the picture back, or build "
                "that folder again (gen_rl_data.py)"
            )
        moved[path] = now
    if moved:
        with contextlib.suppress(OSError):  # a folder it may not write to decodes them again next time
            atomic_write_text(folder / STAMPS, json.dumps(stamps | moved) + "\n")


def picture_digests(paths: list[str], stats: Path) -> dict[str, str]:
    """`picture_digest` of each file. `stats` keeps each file's size, modification time and digest, and a file whose
    size and time are unchanged is taken as unchanged (as git and make do), so that a library's pictures are decoded
    once, not at every load."""
    try:
        old = read_json(stats) if stats.is_file() else {}
    except DataError:
        old = {}  # a damaged record only costs decoding the pictures again
    new = {}
    for path in dict.fromkeys(paths):
        now = stamp(path)
        seen = old.get(path) if isinstance(old, dict) else None
        same = isinstance(seen, list) and len(seen) == 3 and seen[:2] == now
        new[path] = seen if same else [*now, picture_digest(path)]
    if new != old:
        atomic_write_text(stats, json.dumps(new) + "\n")
    return {path: record[2] for path, record in new.items()}


def same_picture_ids(image_ids: list[int], digests: list[str | None]) -> list[int]:
    """Each item's picture as one number: items that share an image id or pixels (a digest, None where unknown) are
    one picture, numbered by the smallest image id among them (so a dataset without copies keeps its image ids)."""
    parent = {}

    def root(x):
        while parent.setdefault(x, x) != x:
            parent[x] = x = parent[parent[x]]
        return x

    for image_id, d in zip(image_ids, digests):
        if d is not None:
            a, b = root(("id", image_id)), root(("pixels", d))
            if a != b:
                parent[b] = a
    smallest = {}
    for image_id in image_ids:
        r = root(("id", image_id))
        smallest[r] = min(smallest.get(r, image_id), image_id)
    return [smallest[root(("id", i))] for i in image_ids]
