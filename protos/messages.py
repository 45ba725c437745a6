"""Every message that crosses a process boundary, one dataclass each, by
the pair of processes it travels between:

  protos/worker_messages.py   router <-> model workers (requests, tokens, embeddings, hellos)
  protos/kv_handoff.py        a prompt's KV, prefill -> router -> decode
  protos/cache_messages.py    anyone <-> the cache service (arena, prefix-cache blocks)
  protos/model_messages.py    router <-> supervisor (models loaded and unloaded)

This module is their one list, which the codec (`protos.codec`) reads: it
turns them into ZeroMQ frames, a msgpack header `{"v": VERSION, "t": <class
name>, "b": <fields>}` followed by one frame per numpy array (out of band,
zero-copy). Nothing here is ever pickled; a class is known on the wire by
its name alone, so names are unique across the four modules.

Keep fields to msgpack-native types (int, float, str, bytes, bool, None, lists,
dicts with str keys), other message dataclasses, or numpy arrays, and annotate
them precisely (`list[int]`, not `list`): the codec checks every value it
receives, list elements included, against these annotations. `Any` is free-form
data (msgpack's own values, no arrays or messages inside).
"""

from __future__ import annotations

from protos.cache_messages import (BlockRef, CacheAlloc, CacheAllocReply, CacheFree, CacheReply, CacheStats,
                                   KVCommit, KVLookup, KVLookupReply, KVRelease, KVReserve, KVReserveReply)
from protos.kv_handoff import ArenaSlice, HeldBlocks, KVHandoff, KVShard
from protos.model_messages import ListModels, LoadModel, ModelRefused, ModelSlot, ModelsState, UnloadModel
from protos.worker_messages import (Cancel, DecodeRequest, EmbedRequest, EmbedResult, ImageInput, PrefillDone,
                                    PrefillRequest, RequestFailed, SamplingParams, TokenBatch, TokenLogprob, TokenUpdate,
                                    VisionDone, VisionRequest, WorkerHello, WorkerLimits)

VERSION = 1

ALL_MESSAGES = [
    SamplingParams,
    ArenaSlice,
    HeldBlocks,
    KVShard,
    KVHandoff,
    TokenLogprob,
    WorkerHello,
    WorkerLimits,
    PrefillRequest,
    ImageInput,
    VisionRequest,
    VisionDone,
    EmbedRequest,
    EmbedResult,
    PrefillDone,
    DecodeRequest,
    TokenUpdate,
    TokenBatch,
    Cancel,
    RequestFailed,
    CacheAlloc,
    CacheAllocReply,
    CacheFree,
    CacheStats,
    CacheReply,
    BlockRef,
    KVLookup,
    KVLookupReply,
    KVRelease,
    KVReserve,
    KVReserveReply,
    KVCommit,
    ModelSlot,
    LoadModel,
    UnloadModel,
    ListModels,
    ModelsState,
    ModelRefused,
]
