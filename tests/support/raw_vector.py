"""A VectorSession stream over the generated stub, for tests that check the wire itself.

No client library: requests are built by hand, answers read one at a time; notices
(request_id 0) are kept aside in ``notices``.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from openenv_grpc.codec import pack
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc


def open_metadata(num_envs: Any, autoreset: str | None = None) -> list[tuple[str, str]]:
    """The call metadata of a VectorSession open."""
    metadata = [("openenv-num-envs", str(num_envs))]
    if autoreset is not None:
        metadata.append(("openenv-autoreset", autoreset))
    return metadata


class RawVector:
    """One VectorSession stream on its own channel."""

    def __init__(
        self,
        target: str,
        num_envs: Any,
        autoreset: str | None = None,
        *,
        metadata: Sequence[tuple[str, str]] | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.channel = grpc.insecure_channel(target, options=list(options))
        self._queue: queue.SimpleQueue[pb.VectorSessionRequest | None] = queue.SimpleQueue()
        stub = pb_grpc.EnvServiceStub(self.channel)
        md = list(metadata) if metadata is not None else open_metadata(num_envs, autoreset)
        self.call = stub.VectorSession(self._requests(), metadata=md)
        self._next_id = 1
        self.notices: list[pb.Notice] = []

    def _requests(self) -> Iterator[pb.VectorSessionRequest]:
        while (request := self._queue.get()) is not None:
            yield request

    def headers(self) -> dict[str, str]:
        """The response headers (blocks until the server sent them or ended the call)."""
        return {key: str(value) for key, value in self.call.initial_metadata() or ()}

    def send(self, request: pb.VectorSessionRequest) -> pb.VectorSessionResponse:
        """Send ``request`` (its id set here) and return its answer."""
        request.request_id = self._next_id
        self._next_id += 1
        self._queue.put(request)
        while True:
            response: pb.VectorSessionResponse = next(self.call)
            if response.request_id == 0:
                self.notices.append(response.notice)
                continue
            assert response.request_id == request.request_id
            return response

    def reset(
        self,
        resets: Sequence[pb.ResetCommand] = (),
        indices: Sequence[int] = (),
        batch: bool = False,
    ) -> pb.VectorSessionResponse:
        command = pb.VectorReset(indices=indices, envs=resets, batch_observation=batch)
        return self.send(pb.VectorSessionRequest(reset=command))

    def step(
        self, actions: Sequence[Message], indices: Sequence[int] = ()
    ) -> pb.VectorSessionResponse:
        command = pb.VectorStep(indices=indices, actions=[pack(a) for a in actions])
        return self.send(pb.VectorSessionRequest(step=command))

    def step_batch(self, action: Message, indices: Sequence[int] = ()) -> pb.VectorSessionResponse:
        command = pb.VectorStep(indices=indices, batch_action=pack(action))
        return self.send(pb.VectorSessionRequest(step=command))

    def state(self, indices: Sequence[int] = ()) -> pb.VectorSessionResponse:
        return self.send(pb.VectorSessionRequest(state=pb.VectorState(indices=indices)))

    def close(self) -> pb.VectorSessionResponse:
        answer = self.send(pb.VectorSessionRequest(close=pb.CloseCommand()))
        self.end()
        return answer

    def end(self) -> None:
        """Half-close the request side and drop the channel."""
        self._queue.put(None)
        self.channel.close()

    def refusal(self) -> grpc.RpcError:
        """The status of a call the server refused at open (raises if it was admitted)."""
        try:
            self.call.initial_metadata()
            next(self.call)
        except grpc.RpcError as exc:
            return exc
        raise AssertionError("the open was admitted")
