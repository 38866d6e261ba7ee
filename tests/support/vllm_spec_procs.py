"""Process bodies for tests/vllm/test_vllm_hma_specs.py: KpoolPdConnector's producer and consumer worker sides
(``kpool_pd.vllm.worker``) over vLLM's tensors of ``tests.support.vllm_spec_caches``, driven with the step
metadata vLLM's scheduler side would hand them (``KpoolPdMetadata`` offers and loads). Each serves jobs
from a queue until told to stop (``None``); an answer is ``("error", traceback)`` if a job failed."""

from __future__ import annotations

import secrets
import time
import traceback

from tests.support.deadlines import patient

NUM_BLOCKS = 24
DONE_S = 60.0  # a pull or a grant's end on a loaded 2-core machine


def pool_of(model: str, seed: int):
    """(kv cache config, vLLM's per-layer caches filled from ``seed``, the connector's pool of them)."""
    from kpool_pd.vllm.groups import transfer_rules
    from kpool_pd.vllm.planes import engine_pool
    from tests.support.vllm_spec_caches import allocate, kv_cache_config

    config, kv_config = kv_cache_config(model, NUM_BLOCKS)
    caches = allocate(config, kv_config, seed)
    layout = config.cache_config.get_resolved_kv_cache_layout()
    return kv_config, caches, engine_pool(caches, kv_config, layout, transfer_rules(kv_config), engine={"test": model})


def write_ring_rows(caches, layers, block: int, positions) -> None:
    """Row ``pos % slots`` of each ring layer's block ``block`` holds the value ``pos`` (the open group's
    committed keys and the drafts' keys a speculative step stored)."""
    for name in layers:
        view = caches[name]  # [blocks, heads, slots, width] bf16
        for pos in positions:
            view[block, :, pos % view.shape[2], :] = float(pos)


def ring_rows(caches, layers, block: int, positions) -> dict[str, list[float]]:
    """Each ring layer's distinct values in the rows of ``positions``, in order."""
    return {name: [sorted(set(caches[name][block, :, pos % caches[name].shape[2], :].float().flatten().tolist()))
                   for pos in positions] for name in layers}


def spec_digest(request_id: str, block_ids) -> str:
    """The prompt digest both sides of a spec-level pair agree on: these engines have no prompts, so the
    request id's bytes stand for its tokens."""
    from kpool_pd.transfer_params import prompt_digest

    return prompt_digest(list(request_id.encode()), [len(group) for group in block_ids])


def producer_main(model: str, port: int, token: str, jobs, results) -> None:
    """Job ``(request_id, block_ids, prompt_len, ring_positions)``: write the ring rows, offer the blocks,
    answer ``(params, the whole buffer's bytes)``; job ``("ended", request_id)``: wait until the grant
    ended (its blocks are vLLM's again), answer True."""
    try:
        from kpool_pd.vllm.metadata import KpoolPdMetadata, Offer, producer_params
        from kpool_pd.vllm.settings import KpoolPdSettings
        from kpool_pd.vllm.worker import ProducerWorker
        from tests.support.vllm_spec_caches import backing, ring_layers

        kv_config, caches, pool = pool_of(model, seed=1)
        settings = KpoolPdSettings.from_extra_config({"listen": f"127.0.0.1:{port}", "peer_token": token,
                                                      "transport": "grpc"}, producer=True)
        worker = ProducerWorker(settings, pool, engine_id=f"spec-producer-{model}", model_identity=model)
        worker.start()
    except Exception:
        results.put(("error", traceback.format_exc()))
        return
    results.put(("ready", None))
    ended: set[str] = set()
    while (job := jobs.get()) is not None:
        try:
            if job[0] == "ended":
                deadline = time.monotonic() + patient(DONE_S)
                while job[1] not in ended and time.monotonic() < deadline:
                    worker.progress.wait_if_idle(KpoolPdMetadata(idle=True))
                    ended |= worker.finished_sending({job[1]})
                results.put(job[1] in ended)
                continue
            request_id, block_ids, prompt_len, positions = job
            write_ring_rows(caches, ring_layers(kv_config), block_ids[-1][0], positions)
            offer = Offer(request_id=request_id, grant_id=secrets.token_hex(16), block_ids=block_ids,
                          prompt_len=prompt_len, prompt_digest=spec_digest(request_id, block_ids))
            worker.offer(KpoolPdMetadata(offers=[offer]))
            params = producer_params(offer, address=settings.advertise, engine_id=worker.engine_id,
                                     lease_s=settings.lease_s)
            results.put((params, backing(caches).numpy().tobytes()))
        except Exception:
            results.put(("error", traceback.format_exc()))
    worker.close()


def consumer_main(model: str, token: str, jobs, results) -> None:
    """A consumer worker per transport, each over its own caches. Job ``(transport, request_id, params,
    block_ids, ring_positions)``: load, wait until it finished, answer ``(buffer bytes before, after, load
    errors, ring rows)``."""
    try:
        from kpool_pd.vllm.metadata import KpoolPdMetadata, Load
        from kpool_pd.transfer_params import DecodeParams
        from kpool_pd.vllm.settings import KpoolPdSettings
        from kpool_pd.vllm.worker import ConsumerWorker
        from tests.support.vllm_spec_caches import backing, ring_layers

        workers = {}
        for index, transport in enumerate(("ucx", "grpc")):
            kv_config, caches, pool = pool_of(model, seed=2 + index)
            settings = KpoolPdSettings.from_extra_config({"peer_token": token, "transport": transport,
                                                          "integrity": True, "producers": ["127.0.0.1"]},
                                                         producer=False)
            worker = ConsumerWorker(settings, pool, engine_id=f"spec-consumer-{transport}", model_identity=model)
            worker.start()
            workers[transport] = (worker, caches)
        rings = ring_layers(kv_config)
    except Exception:
        results.put(("error", traceback.format_exc()))
        return
    results.put(("ready", None))
    while (job := jobs.get()) is not None:
        try:
            transport, request_id, params, block_ids, positions = job
            worker, caches = workers[transport]
            before = backing(caches).numpy().tobytes()
            worker.load(KpoolPdMetadata(loads=[Load(request_id=request_id, params=DecodeParams.parse(params),
                                                    block_ids=block_ids, digest=spec_digest(request_id, block_ids))]))
            finished: set[str] = set()
            failed: set[str] = set()
            deadline = time.monotonic() + patient(DONE_S)
            while request_id not in finished and time.monotonic() < deadline:
                worker.progress.wait_if_idle(KpoolPdMetadata(idle=True))
                done, lost = worker.finished_recving()
                finished, failed = finished | done, failed | lost
            if request_id not in finished:
                raise TimeoutError(f"{request_id} did not finish loading within {DONE_S} s")
            results.put((before, backing(caches).numpy().tobytes(), failed,
                         ring_rows(caches, rings, block_ids[-1][0], positions)))
        except Exception:
            results.put(("error", traceback.format_exc()))
    for worker, _ in workers.values():
        worker.close()
