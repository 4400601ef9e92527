#!/usr/bin/env python3
"""A minimal CapServe client: one chat completion, streamed to stdout (Debian python3-grpcio, stubs from the build).

usage: /usr/bin/python3 tools/capserve_chat.py --addr localhost:50051 --stubs build/proto/python "Hello"
"""
import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("message")
    parser.add_argument("--addr", default="localhost:50051")
    parser.add_argument("--stubs", default="build/proto/python", help="directory of the generated Python stubs")
    parser.add_argument("--system", default="")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    sys.path.insert(0, args.stubs)
    import grpc
    from capserve.v1 import inference_pb2 as pb
    from capserve.v1 import inference_pb2_grpc as rpc

    # Request text fields are UTF-8 bytes (see proto/capserve/v1/inference.proto).
    messages = ([pb.ChatMessage(role=b"system", content=args.system.encode())] if args.system else []) + [
        pb.ChatMessage(role=b"user", content=args.message.encode())]
    request = pb.ChatRequest(messages=messages,
                             sampling=pb.SamplingOptions(max_tokens=args.max_tokens, temperature=args.temperature))
    stub = rpc.InferenceStub(grpc.insecure_channel(args.addr))
    try:
        for chunk in stub.ChatStream(request, timeout=args.timeout):
            sys.stdout.write(chunk.delta)
            sys.stdout.flush()
            if chunk.finish_reason:
                reason = pb.FinishReason.Name(chunk.finish_reason)
                print(f"\n[{reason}; prompt {chunk.usage.prompt_tokens} tokens, completion "
                      f"{chunk.usage.completion_tokens}; MoE slots dropped {chunk.moe.dropped}, "
                      f"rerouted {chunk.moe.rerouted} of {chunk.moe.assignments}]")
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
