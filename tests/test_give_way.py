"""The worker gives way to large bodies being prepared (`Batcher(preparing=...)`): no slice of work starts while
one is counted, at most a slice's wait per turn, so a stream of them slows the worker and never stops it."""

import asyncio

from smallstate_lm.service.batcher import Batcher, BatchLimits, Job


def work(started: list):
    def run(jobs, deliver):
        started.append(len(jobs))
        for job in jobs:
            yield
            deliver(job, "done")

    return run


def test_no_work_starts_while_a_body_is_prepared_and_it_starts_once_none_is():
    async def main():
        started, preparing = [], [1]
        batcher = Batcher(work(started), BatchLimits(batching=False, slice_s=30.0), preparing=lambda: preparing[0])
        batcher.start()
        future = batcher.submit(Job(1))
        await asyncio.sleep(0.3)
        assert not started, "the worker waited for the body being prepared"
        preparing[0] = 0
        batcher.poke()
        assert await asyncio.wait_for(future, 10) == "done"
        await batcher.close()

    asyncio.run(main())


def test_a_stream_of_bodies_never_stops_the_worker():
    async def main():
        started = []
        batcher = Batcher(work(started), BatchLimits(batching=False, slice_s=0.01), preparing=lambda: 1)
        batcher.start()
        futures = [batcher.submit(Job(1)) for _ in range(5)]
        assert await asyncio.wait_for(asyncio.gather(*futures), 30) == ["done"] * 5
        await batcher.close()

    asyncio.run(main())
