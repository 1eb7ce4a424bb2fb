"""A running engine keeps what its start made out of the garbage collector's full collections
(they walked ~220k objects, 100-300 ms with the GIL held, every few agent turns); close() hands
it back, so nothing it held stays uncollectable."""

from __future__ import annotations

import gc
import weakref

from engine import Engine


class Node:
    pass


def test_what_an_engine_start_made_is_frozen_until_it_closes(tiny_model_dir):
    gc.disable()  # a cycle left as garbage just before the start, not yet collected
    try:
        node = Node()
        node.me = node
        ref = weakref.ref(node)
        del node
        engine = Engine(str(tiny_model_dir), prefix_cache=False)
    finally:
        gc.enable()
    try:
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert ref() is not None  # frozen: no collection walks it
    finally:
        engine.close()
    gc.collect()
    assert ref() is None  # collectable again once the engine is closed
