"""The Batches call on the server (docs/design/stream-protocol.md), driven by hand on the wire
(``rawclient.RawBatches``): grants in any order, each batch sent once with the bytes StreamBatches
and a plain one-server stream give; revokes; leases released on the call; expect_* refusals;
the server id; invalid grants and max_grants; sharing with StreamBatches; drain; failures.

Real servers on 127.0.0.1:0, real workers. Nothing here asserts a duration: a slow batch is made
slow by the data (``batchd_testdata.Paced``: one sample stalls), and order is what is checked.
"""

from __future__ import annotations

import pathlib
import threading

import albumentations as A
import grpc
import numpy as np
import pytest

import batchd.server.serve.service as service_module
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc
from helpers import free_port, wait_until, write_png
from rawclient import RawBatches, RawSession, digest, server_id, tensors

pytestmark = pytest.mark.timeout(240)

N_TEST, BATCH = 10_000, 250
NUM_BATCHES = N_TEST // BATCH
PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"
AUG = A.Compose([A.HorizontalFlip(p=0.5), A.Affine(rotate=(-20, 20), p=0.7), A.RandomBrightnessContrast(p=0.5)])


def _fmnist(fmnist_root) -> dict:
    return {"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}


def _open(**kw) -> pb.StreamBatchesRequest:
    """The request every test reads (random augmentation: the bytes depend on seed, epoch and index)."""
    fields = dict(dataset="fmnist-test", batch_size=BATCH, shuffle=True, seed=5, epoch=1,
                  pipeline=pb.Pipeline(preset="aug"))
    fields.update(kw)
    return pb.StreamBatchesRequest(**fields)


@pytest.fixture(scope="module")
def server(fmnist_root, tmp_path_factory):
    from conftest import running_server

    with running_server(cache_dir=tmp_path_factory.mktemp("cache"), workers=2, share_window=NUM_BATCHES,
                        max_leases_per_session=NUM_BATCHES + 8, datasets=_fmnist(fmnist_root), metrics_port=0,
                        pipelines={"aug": A.to_dict(AUG)}) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(fmnist_root, tmp_path_factory) -> dict[int, str]:
    """Batch index -> digest from a plain StreamBatches call (every batch, in order) on a server of
    its own: the bytes any server gives."""
    from conftest import running_server

    with running_server(cache_dir=tmp_path_factory.mktemp("cache-ref"), workers=1, datasets=_fmnist(fmnist_root),
                        pipelines={"aug": A.to_dict(AUG)}) as srv:
        with grpc.insecure_channel(srv.address) as channel:
            stub = loader_pb2_grpc.BatchLoaderStub(channel)
            got = [(b.batch_index, digest(tensors(b))) for b in stub.StreamBatches(_open(), timeout=120)]
    assert [b for b, _ in got] == list(range(NUM_BATCHES))
    return dict(got)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield loader_pb2_grpc.BatchLoaderStub(channel)


def _totals(stub) -> pb.StatsTotals:
    return stub.Stats(pb.StatsRequest(), timeout=10).totals


def _delta(after: pb.StatsTotals, before: pb.StatsTotals, *names: str) -> dict[str, int]:
    return {n: getattr(after, n) - getattr(before, n) for n in names}


def _error(e: grpc.RpcError) -> pb.ErrorDetail | None:
    for key, value in e.trailing_metadata() or ():
        if key == "batchd-error-bin":
            return pb.ErrorDetail.FromString(value)
    return None


def _settled(server) -> bool:
    return not server.loader.streams and server.loader.leases.held_total == 0


# --- grants, order, bytes ------------------------------------------------------------------------


def test_grants_in_any_order_are_each_sent_once_with_the_bytes_of_every_other_path(server, stub, reference):
    """A permutation of the epoch granted in chunks as batches arrive (some in the open message):
    every batch arrives once, with the bytes a plain stream on another server gives and those a
    strided StreamBatches call on this server gives; half-closing ends the call (OK)."""
    strided = {b.batch_index: digest(tensors(b))
               for b in stub.StreamBatches(_open(batch_stride=3, batch_offset=1), timeout=120)}
    assert sorted(strided) == list(range(1, NUM_BATCHES, 3))
    assert all(strided[b] == reference[b] for b in strided)

    order = [int(b) for b in np.random.default_rng(0).permutation(NUM_BATCHES)]
    chunks = [order[:5]]
    rest, sizes = order[5:], iter([1, 7, 2, 3, 6, 1, 4, 5] * 10)
    while rest:
        n = next(sizes)
        chunks.append(rest[:n])
        rest = rest[n:]
    before = _totals(stub)
    call = RawBatches(stub, _open(), grant=chunks[0])
    got: list[tuple[int, str]] = []
    pending = iter(chunks[1:])
    for batch in call:
        assert batch.num_batches == NUM_BATCHES and batch.epoch == 1
        got.append((batch.batch_index, digest(tensors(batch))))
        chunk = next(pending, None)
        if chunk is not None:
            call.send(grant=chunk)
            if chunk is chunks[-1]:
                call.close()
    assert call.call.code() == grpc.StatusCode.OK
    indices = [b for b, _ in got]
    assert sorted(indices) == list(range(NUM_BATCHES)), "a batch missing or sent twice"
    assert indices != sorted(indices), "sent in index order: the grant order was not followed"
    assert all(d == reference[b] for b, d in got), "a batch's bytes differ from a plain stream's"
    info = stub.DescribeDataset(pb.DescribeDatasetRequest(name="fmnist-test"), timeout=10)
    assert server_id(call.call) == info.server_id != ""
    assert _delta(_totals(stub), before, "batches_calls_started", "control_messages", "batches_granted",
                  "streams_finished") == {"batches_calls_started": 1, "control_messages": len(chunks) + 1,  # + done
                                          "batches_granted": NUM_BATCHES, "streams_finished": 1}


def test_leases_and_progress_on_the_call_without_release_rpcs(server, stub, reference):
    """Shared memory: each lease goes back on the next control message (piggy-backed on a grant,
    or alone; the client half-closes after the last one: a release after the half-close would
    need ReleaseLeases), and progress rides along; no ReleaseLeases call is made, every slot is
    free again at the end, and the counters (Stats, /metrics) say so."""
    from test_stats import scrape

    with grpc.insecure_channel(server.address) as channel:
        session = RawSession(channel)
        before = _totals(stub)
        call = RawBatches(loader_pb2_grpc.BatchLoaderStub(channel),
                          _open(transport=pb.TRANSPORT_SHARED_MEMORY, session=session.session, stream_tag="b1"),
                          grant=range(4))
        got, next_grant = [], 4
        for batch in call:
            assert batch.segment and batch.lease, f"batch {batch.batch_index} came inline"
            got.append((batch.batch_index, digest(tensors(batch))))
            if next_grant < NUM_BATCHES:
                call.send(grant=[next_grant], release=[batch.lease])
                next_grant += 1
            else:
                call.send(release=[batch.lease])
            if len(got) == 10:  # what the training loop took, as a client reports it
                call.send(progress=pb.StreamProgress(batches_taken=9, samples_taken=9 * BATCH, wait_ratio=0.25,
                                                     verdict="cpu-bound"))
                st = wait_until(lambda: stub.Stats(pb.StatsRequest(), timeout=10).streams[0].verdict == "cpu-bound")
                assert st, "the progress sent on the call did not reach the stream's stats"
                (st,) = stub.Stats(pb.StatsRequest(), timeout=10).streams
                assert (st.call, st.batches_taken, st.samples_taken, st.wait_ratio) == ("Batches", 9, 9 * BATCH, 0.25)
            if len(got) == NUM_BATCHES:
                call.close()
        assert call.call.code() == grpc.StatusCode.OK
        assert sorted(b for b, _ in got) == list(range(NUM_BATCHES))
        assert all(d == reference[b] for b, d in got)
        assert wait_until(lambda: server.loader.leases.held(session.session) == 0), \
            f"{server.loader.leases.held(session.session)} leases still held"
        delta = _delta(_totals(stub), before, "release_leases_calls", "leases_released_on_calls",
                       "leases_released_by_rpc", "bytes_copied_shm")
        assert delta == {"release_leases_calls": 0, "leases_released_on_calls": NUM_BATCHES,
                         "leases_released_by_rpc": 0, "bytes_copied_shm": 0}, delta
        totals, metrics = _totals(stub), scrape(server.metrics_address)
        assert metrics[("batchd_leases_released_total", (("via", "call"),))] == totals.leases_released_on_calls
        assert metrics[("batchd_control_rpcs_total", (("method", "ReleaseLeases"),))] == totals.release_leases_calls
        assert metrics[("batchd_control_messages_total", ())] == totals.control_messages > 0
        assert metrics[("batchd_batches_granted_total", ())] == totals.batches_granted >= NUM_BATCHES
        session.close()
    assert wait_until(lambda: _settled(server))


@pytest.fixture
def paced_server(make_server, request):
    """Paced samples (image uint8 [4, 4] filled with i % 256, label i); ``request.param`` (a dict)
    replaces Paced's args, e.g. a stalling sample. Three workers: three batches granted at once
    are built side by side (a stalling one holds up only its own worker)."""
    args = {"n": 64, **getattr(request, "param", {})}
    return make_server(workers=3, python_path=[str(PYDATA)], share_window=16,
                       datasets={"paced": {"kind": "python", "factory": "batchd_testdata:Paced", "args": args}})


def _paced(**kw) -> pb.StreamBatchesRequest:
    return pb.StreamBatchesRequest(dataset="paced", batch_size=4, **kw)


def _labels(batch: pb.Batch) -> list[int]:
    return tensors(batch)["label"].tolist()


# batch 1 (samples 4..7) takes 3 s: batches 0 and 2 are built long before it
@pytest.mark.parametrize("paced_server", [{"stall_at": 5, "stall_seconds": 3.0}], indirect=True)
def test_batches_are_sent_as_built_and_the_stats_show_the_call(paced_server):
    with grpc.insecure_channel(paced_server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        call = RawBatches(stub, _paced(), grant=[0, 1, 2])
        first, second = next(call), next(call)
        assert {first.batch_index, second.batch_index} == {0, 2}, "a batch built later was sent first"
        (st,) = stub.Stats(pb.StatsRequest(), timeout=10).streams
        assert (st.call, st.next_batch, st.granted, st.batches_sent, st.num_batches) == ("Batches", 1, 1, 2, 16)
        assert st.batches_in_flight == 1 and st.batches_ready == 0
        call.close()
        last = next(call)
        assert last.batch_index == 1 and _labels(last) == [4, 5, 6, 7]
        with pytest.raises(StopIteration):
            next(call)
        assert call.call.code() == grpc.StatusCode.OK
    assert wait_until(lambda: _settled(paced_server))


def test_half_closing_with_nothing_granted_ends_the_call(paced_server):
    with grpc.insecure_channel(paced_server.address) as channel:
        call = RawBatches(loader_pb2_grpc.BatchLoaderStub(channel), _paced())
        call.close()
        assert list(call) == [] and call.call.code() == grpc.StatusCode.OK
    assert wait_until(lambda: _settled(paced_server))


@pytest.mark.parametrize("done", [True, False], ids=["done", "no-done"])
def test_only_done_counts_a_call_finished_and_what_was_granted_is_sent_either_way(server, stub, done):
    """A request stream that ends without ``done`` is what the server sees when a client's cancel
    reads as a half-close (gRPC ends the request iterator before the cancellation shows): every
    grant is still sent, but the stream counts cancelled; with ``done`` it counts finished."""
    before = _totals(stub)
    call = RawBatches(stub, _open(), grant=[3, 1, 4])
    call.close(done=done)
    assert sorted(b.batch_index for b in call) == [1, 3, 4] and call.call.code() == grpc.StatusCode.OK
    assert wait_until(lambda: _settled(server))
    assert _delta(_totals(stub), before, "streams_finished", "streams_cancelled") == {
        "streams_finished": int(done), "streams_cancelled": int(not done)}


# --- revoke ---------------------------------------------------------------------------------------


def _in_flight(pool, b: int) -> bool:
    return any(job.batch_index == b for job in dict(pool._in_flight).values())  # dict(): one atomic copy


# batch 6 (samples 24..27) takes 3 s: it cannot have been sent before the revoke arrives
@pytest.mark.parametrize("paced_server", [{"stall_at": 25, "stall_seconds": 3.0}], indirect=True)
def test_a_revoked_batch_is_not_sent_and_its_built_copy_is_shared(paced_server):
    pool = paced_server.loader.pool
    with grpc.insecure_channel(paced_server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        call = RawBatches(stub, _paced(), grant=range(7))
        got = [next(call) for _ in range(6)]
        assert sorted(b.batch_index for b in got) == list(range(6))
        assert wait_until(lambda: _in_flight(pool, 6))  # being built: it will be, revoked or not
        call.send(revoke=[6, 9, 0])  # 9 was never granted, 0 was sent already: both ignored
        assert wait_until(lambda: pool.batches_built == 7, timeout=30)
        # the revoked batch's copy stays for sharing: a second call with the same request gets it built
        other = RawBatches(stub, _paced(), grant=[6])
        assert _labels(next(other)) == [24, 25, 26, 27]
        other.close()
        assert list(other) == [] and other.call.code() == grpc.StatusCode.OK
        assert pool.batches_built == 7
        call.send(grant=[7])
        assert next(call).batch_index == 7
        call.close()
        assert list(call) == [], "the revoked batch was sent"
        assert call.call.code() == grpc.StatusCode.OK
        assert stub.Stats(pb.StatsRequest(), timeout=10).totals.batches_revoked == 1
    assert wait_until(lambda: _settled(paced_server))


# --- refusals ---------------------------------------------------------------------------------------


def test_invalid_grants_and_messages_are_refused_naming_what(server, stub):
    def refused(*messages, grant=()) -> grpc.RpcError:
        """The error a call ends with (batches sent before it are read and dropped)."""
        call = RawBatches(stub, _open(), grant=grant, timeout=60)
        for msg in messages:
            call.send(**msg)
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
        return e.value

    before = _totals(stub)
    e = refused(grant=[2, NUM_BATCHES])
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and f"batch {NUM_BATCHES} is not in [0, {NUM_BATCHES})" in e.details()
    e = refused({"done": True}, {"grant": [NUM_BATCHES - 1]}, grant=range(NUM_BATCHES - 1))  # (seconds of work left)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "a grant after `done`" in e.details()
    e = refused({"done": True}, {"msg": pb.BatchesControl(open=_open(epoch=2))}, grant=range(NUM_BATCHES - 1))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "an `open` after `done`" in e.details()
    # a first message without open; bytes that are no BatchesControl
    with grpc.insecure_channel(server.address) as channel:
        bidi = channel.stream_stream("/batchd.v1.BatchLoader/Batches", request_serializer=None,
                                     response_deserializer=None)
        for payload, text in ((pb.BatchesControl(grant=[1]).SerializeToString(), "must carry `open`"),
                              (b"\xff\x00garbage", "not a valid protobuf message")):
            with pytest.raises(grpc.RpcError) as e:
                list(bidi(iter([payload]), timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in e.value.details()
    assert wait_until(lambda: _settled(server))
    assert _delta(_totals(stub), before, "streams_failed")["streams_failed"] == 3  # the other two opened none


def test_grants_are_idempotent_and_a_batch_sent_or_revoked_is_sent_again(server, stub, reference):
    """A grant of a batch outstanding on the call does not send it twice; one of a batch already
    sent (or revoked) sends it again, with the same bytes: the client needs no record of which
    copies are in flight to stay correct."""
    call = RawBatches(stub, _open(), grant=[3, 1, 3, 1])
    got = [next(call), next(call)]
    assert sorted(b.batch_index for b in got) == [1, 3]
    call.send(grant=[3, 5, 5])  # 3 was sent: again; 5 twice in one message: once
    got += [next(call), next(call)]
    call.send(grant=[7], revoke=[7])  # granted and revoked in one message: not sent...
    call.send(grant=[7])  # ... until granted again
    got.append(next(call))
    call.close()
    got += list(call)
    assert sorted(b.batch_index for b in got) == [1, 3, 3, 5, 7] and call.call.code() == grpc.StatusCode.OK
    for b in got:
        assert digest(tensors(b)) == reference[b.batch_index], b.batch_index
    assert wait_until(lambda: _settled(server))


def test_one_call_switches_to_the_next_epoch_with_a_later_open(server, stub, reference, fmnist_root, tmp_path):
    """A later ``open`` switches the call to another request: the previous one's grants are
    revoked and its stream ends as finished, the batches after it carry ``open_seq`` 1, 2, ...
    and have that request's bytes; grants in the switching message belong to the new request."""
    from conftest import running_server

    with running_server(cache_dir=tmp_path, workers=1, datasets=_fmnist(fmnist_root),
                        pipelines={"aug": A.to_dict(AUG)}) as ref:
        with grpc.insecure_channel(ref.address) as channel:
            epoch2 = {b.batch_index: digest(tensors(b)) for b in
                      loader_pb2_grpc.BatchLoaderStub(channel).StreamBatches(_open(epoch=2), timeout=120)}
    assert epoch2[0] != reference[0]
    before = _totals(stub)
    call = RawBatches(stub, _open(), grant=[0, 1])
    first = [next(call), next(call)]
    assert {(b.batch_index, b.open_seq) for b in first} == {(0, 0), (1, 0)}
    call.send(grant=range(2, NUM_BATCHES))  # the rest of epoch 1, revoked by the switch below
    call.send(msg=pb.BatchesControl(open=_open(epoch=2), grant=[0, 1, 2]))
    got = {}
    for b in call:
        if b.open_seq == 0:  # sent before the switch
            assert digest(tensors(b)) == reference[b.batch_index]
            continue
        assert b.open_seq == 1 and b.epoch == 2 and b.batch_index not in got
        got[b.batch_index] = digest(tensors(b))
        if len(got) == 3:
            call.send(msg=pb.BatchesControl(open=_open(epoch=3)))  # a second switch, nothing granted
            call.close()
    assert got == {b: epoch2[b] for b in range(3)} and call.call.code() == grpc.StatusCode.OK
    assert wait_until(lambda: _settled(server))
    delta = _delta(_totals(stub), before, "streams_finished", "streams_cancelled", "streams_failed",
                   "batches_calls_started")
    assert delta == {"streams_finished": 3, "streams_cancelled": 0, "streams_failed": 0, "batches_calls_started": 1}


def test_the_call_advertises_the_servers_capacity(make_server, fmnist_root):
    """``batchd-workers`` (its worker processes) and, over shared memory, ``batchd-max-leases``
    in the initial metadata; ``BatchTimings.workers`` in every batch."""
    srv = make_server(workers=3, max_leases_per_session=5, datasets=_fmnist(fmnist_root),
                      pipelines={"aug": A.to_dict(AUG)})
    with grpc.insecure_channel(srv.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        call = RawBatches(stub, _open(), grant=[0])
        batch = next(call)
        metadata = dict(call.call.initial_metadata())
        assert metadata["batchd-workers"] == "3" and "batchd-max-leases" not in metadata
        assert batch.timings.workers == 3
        call.cancel()
        session = RawSession(channel)
        call = RawBatches(stub, _open(transport=pb.TRANSPORT_SHARED_MEMORY, session=session.session), grant=[0])
        batch = next(call)
        metadata = dict(call.call.initial_metadata())
        assert metadata["batchd-workers"] == "3" and metadata["batchd-max-leases"] == "5" and batch.segment
        call.cancel()
        session.close()


def test_more_grants_than_max_grants_are_refused(make_server, fmnist_root):
    srv = make_server(workers=1, max_grants=8, datasets=_fmnist(fmnist_root), pipelines={"aug": A.to_dict(AUG)})
    with grpc.insecure_channel(srv.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        call = RawBatches(stub, _open(), grant=range(9))
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "9 batches granted and not yet sent" in e.value.details() and "max_grants=8" in e.value.details()
        # 8 at a time are fine: only grants not yet sent count
        call = RawBatches(stub, _open(), grant=range(8))
        got = [next(call).batch_index for _ in range(8)]
        call.send(grant=range(8, 16))
        call.close()
        got += [b.batch_index for b in call]
        assert sorted(got) == list(range(16)) and call.call.code() == grpc.StatusCode.OK


def test_expected_dataset_is_checked_at_open_on_both_calls(server, stub):
    info = stub.DescribeDataset(pb.DescribeDatasetRequest(name="fmnist-test"), timeout=10)
    wrong = {
        "expect_num_samples": (9_999, f"num_samples 9999 vs {N_TEST}"),
        "expect_fingerprint": ("f" * 32, f"dataset fingerprint {'f' * 32} vs {info.fingerprint}"),
        "expect_build_fingerprint": ("b" * 32, f"build fingerprint {'b' * 32} vs {info.build_fingerprint}"),
    }
    for name, (value, text) in wrong.items():
        request = _open(**{name: value})
        stream = stub.StreamBatches(request, timeout=30)
        call = RawBatches(stub, request, grant=[0])
        for c in (stream, call):
            with pytest.raises(grpc.RpcError) as e:
                next(c)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
            detail = _error(e.value)
            assert detail.type == "DatasetChangedError" and text in detail.message and text in e.value.details(), \
                (name, detail.message)
            assert detail.dataset == "fmnist-test"
        assert server_id(stream) == server_id(call.call) == info.server_id  # a refused call names the server too
    matching = _open(expect_num_samples=N_TEST, expect_fingerprint=info.fingerprint,
                     expect_build_fingerprint=info.build_fingerprint)
    assert next(stub.StreamBatches(matching, timeout=60)).batch_index == 0
    call = RawBatches(stub, matching, grant=[3])
    call.close()
    assert [b.batch_index for b in call] == [3] and call.call.code() == grpc.StatusCode.OK
    assert wait_until(lambda: _settled(server))


def test_server_id_changes_with_a_restart_and_descriptions_are_computed_once(fmnist_root, tmp_path, monkeypatch):
    from conftest import running_server

    computed: list[str] = []
    real = service_module.dataset_info

    def counted(loader, name):
        computed.append(name)
        return real(loader, name)

    monkeypatch.setattr(service_module, "dataset_info", counted)
    address = f"127.0.0.1:{free_port()}"
    ids = []
    for _ in range(2):  # the same address, a new server process state each time
        computed.clear()
        with running_server(address=address, cache_dir=tmp_path / "cache", workers=1, datasets=_fmnist(fmnist_root),
                            pipelines={"aug": A.to_dict(AUG)}) as srv:
            with grpc.insecure_channel(address) as channel:
                stub = loader_pb2_grpc.BatchLoaderStub(channel)
                infos = [stub.DescribeDataset(pb.DescribeDatasetRequest(name="fmnist-test"), timeout=10)
                         for _ in range(3)]
                infos += [stub.ListDatasets(pb.ListDatasetsRequest(), timeout=10).datasets[0] for _ in range(2)]
                assert all(i == infos[0] for i in infos)
                assert computed == ["fmnist-test"], f"the description was computed {len(computed)} times"
                stream = stub.StreamBatches(_open(), timeout=60)
                next(stream)
                call = RawBatches(stub, _open(), grant=[0])
                next(call)
                assert server_id(stream) == server_id(call.call) == infos[0].server_id == srv.loader.server_id
                stream.cancel()
                call.cancel()
                totals = stub.Stats(pb.StatsRequest(), timeout=10).totals
                assert (totals.describe_dataset_calls, totals.list_datasets_calls) == (3, 2)
                ids.append(infos[0].server_id)
    assert len(ids[0]) == 32 and ids[0] != ids[1], ids


# --- sharing --------------------------------------------------------------------------------------


def test_a_batches_call_and_a_stream_batches_call_share_one_computation(server, stub, reference):
    """The Batches call opens first (nothing granted yet); a StreamBatches call of the same request
    joins its computation and reads the epoch; the Batches call then grants every batch and gets
    them all from what was built (kept as history: share_window is the epoch): built once."""
    loader, pool = server.loader, server.loader.pool
    assert wait_until(lambda: _settled(server))
    started, built = loader.counters["computations_started"], pool.batches_built
    call = RawBatches(stub, _open(seed=77))
    assert wait_until(lambda: len(loader.streams) == 1)
    streamed = [b.batch_index for b in stub.StreamBatches(_open(seed=77), timeout=120)]
    assert streamed == list(range(NUM_BATCHES))
    call.send(grant=list(range(NUM_BATCHES))[::-1])
    call.close()
    got = sorted(b.batch_index for b in call)
    assert got == list(range(NUM_BATCHES)) and call.call.code() == grpc.StatusCode.OK
    assert loader.counters["computations_started"] - started == 1
    assert pool.batches_built - built == NUM_BATCHES, "a batch was built twice"
    assert wait_until(lambda: _settled(server))


# --- shutdown, failures, leaks --------------------------------------------------------------------


# batch 2 (samples 8..11) takes 20 s: the call is waiting for it when the server shuts down
@pytest.mark.parametrize("paced_server", [{"stall_at": 9, "stall_seconds": 20.0}], indirect=True)
def test_drain_ends_a_batches_call_with_unavailable(paced_server):
    with grpc.insecure_channel(paced_server.address) as channel:
        call = RawBatches(loader_pb2_grpc.BatchLoaderStub(channel), _paced(), grant=[0, 1, 2])
        assert sorted(next(call).batch_index for _ in range(2)) == [0, 1]
        stopper = threading.Thread(target=paced_server.stop, kwargs={"grace": 60})
        stopper.start()
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
        stopper.join(15)  # well under the grace period: the call ended, nothing waited for batch 2
        assert not stopper.is_alive()


def test_a_failed_batch_ends_the_call_with_its_error_after_the_batches_before_it(make_server, tmp_path):
    """Samples 0..7 (sorted files), sample 5 not an image: batch 2 fails. Granted 3, 0, 2, 1: batches
    0 and 1 are delivered, then the call ends with DATA_LOSS and the ErrorDetail StreamBatches gives."""
    root = tmp_path / "images"
    rng = np.random.default_rng(0)
    for i in range(8):
        path = root / "a" / f"{i:02d}.png"
        if i == 5:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"not an image at all")
        else:
            write_png(path, rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    srv = make_server(workers=1, datasets={"imgs": {"kind": "imagefolder", "root": str(root)}})
    request = pb.StreamBatchesRequest(dataset="imgs", batch_size=2)
    with grpc.insecure_channel(srv.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        with pytest.raises(grpc.RpcError) as streamed:
            for _ in stub.StreamBatches(request, timeout=60):
                pass
        call = RawBatches(stub, request, grant=[3, 0, 2, 1])
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for batch in call:
                got.append(batch.batch_index)
    assert {0, 1} <= set(got) and 2 not in got, got
    assert e.value.code() == streamed.value.code() == grpc.StatusCode.DATA_LOSS
    detail, expected = _error(e.value), _error(streamed.value)
    assert detail == expected and detail.type == "SampleError" and list(detail.indices) == [5], detail
    assert list(detail.paths) == ["a/05.png"]
    assert wait_until(lambda: _settled(srv))


def test_cancelled_calls_leak_nothing(make_server, fmnist_root):
    """100 rounds of (open a shared-memory Batches call, grant 6, read 1-3 batches, cancel), the
    leases received released on the call in half the rounds (then cancelled at once: the release
    may be lost with the call, so the abandon report names only the leases still held, none) and
    held and named in the abandon report in the others: every lease, call record, stream, reader
    thread and slot comes back."""
    from test_leaks import MAX_SLOTS, _footprint, _settled as settled

    srv = make_server(workers=2, max_slots=MAX_SLOTS, max_leases_per_session=128, datasets=_fmnist(fmnist_root),
                      pipelines={"aug": A.to_dict(AUG)})
    with grpc.insecure_channel(srv.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        session = RawSession(channel)

        def one_round(i: int) -> None:
            tag = f"call-{i}"
            call = RawBatches(stub, _open(batch_size=100, transport=pb.TRANSPORT_SHARED_MEMORY,
                                          session=session.session, stream_tag=tag), grant=range(6))
            received = []
            for _ in range(1 + i % 3):
                batch = next(call)
                assert batch.segment and batch.lease, f"round {i}: batch {batch.batch_index} came inline"
                received.append(batch.lease)
            if i % 2:
                call.send(release=received)
                held = []
            else:
                held = received
            call.cancel()
            session.release(held, abandoned=tag, received=held)

        for i in range(10):  # warm up: the pool's threads and slots exist
            one_round(i)
        assert wait_until(lambda: srv.loader.leases.held_total == 0 and not srv.loader.streams)
        before = _footprint(srv)
        for i in range(10, 110):
            one_round(i)
        assert wait_until(lambda: settled(srv, before), timeout=30), f"{before} -> {_footprint(srv)}"
        session.close()
    assert wait_until(lambda: srv.loader.leases.sessions == 0 and srv.service.long_calls == 0)


def test_a_worker_failure_ends_the_call_with_a_worker_error_after_the_batches_before_it(make_server, fmnist_root):
    """The worker building batch 2 is SIGKILLed (max_task_retries 0: the batch fails at once):
    granted 2, 0, 1, batches 0 and 1 are delivered, then INTERNAL with a WorkerError ErrorDetail.
    Three workers: the three batches are built side by side, so the kill takes batch 2 alone."""
    from procs import SLOW
    from test_faults import BatchKiller

    srv = make_server(workers=3, max_task_retries=0, datasets=_fmnist(fmnist_root),
                      pipelines={"slow": A.to_dict(SLOW)})
    killer = BatchKiller(srv.loader.pool, 2)
    killer.start()
    got = []
    try:
        with grpc.insecure_channel(srv.address) as channel:
            call = RawBatches(loader_pb2_grpc.BatchLoaderStub(channel),
                              _open(batch_size=16, pipeline=pb.Pipeline(preset="slow")), grant=[2, 0, 1])
            with pytest.raises(grpc.RpcError) as e:
                for batch in call:
                    got.append(batch.batch_index)
    finally:
        killer.stop.set()
        killer.join(5)
    assert killer.killed and sorted(got) == [0, 1], got
    detail = _error(e.value)
    assert e.value.code() == grpc.StatusCode.INTERNAL and detail.type == "WorkerError", (e.value.code(), detail)
    assert "batch 2 of dataset 'fmnist-test'" in detail.message and "Traceback" not in detail.message
    assert wait_until(lambda: _settled(srv))
