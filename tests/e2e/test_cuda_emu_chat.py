"""capserve --device cuda on 2 ranks, built against the CUDA emulation (tests/cuda_emu: the very sources of
capserve over the emulated CUDA runtime, cuBLAS and the NCCL stand-in, a GPU per rank): a streamed chat is
served with its MoE statistics, which with a capacity factor below 1 show dropped assignments; start-up
reports each rank's device memory, and a model that does not fit the GPU ends the job with one clear line
per rank."""

import os
import re
import subprocess
import sys
import unittest

from capserve_e2e import BIN, LAUNCH, MODEL, NP, ServerTestCase, chat_request, main, pb

PROMPT = "Tell me about the mixture of experts."


class CudaEmuChatTest(ServerTestCase):
    # A small step bound: --device cuda sizes every step buffer at start-up with one step of that many tokens,
    # which the emulation runs slowly.
    FLAGS = ["--device", "cuda", "--capacity-factor", "0.75", "--capacity-policy", "drop", "--max-batched-tokens",
             "256"]

    def test_streamed_chat_reports_its_moe_statistics(self):
        request = chat_request(PROMPT, max_tokens=24, request_id="cuda-emu-1")
        chunks = list(self.stub.ChatStream(request, timeout=300))
        self.assertGreater(len(chunks), 1)
        text = "".join(c.delta for c in chunks)
        self.assertTrue(text)
        last = chunks[-1]
        self.assertIn(last.finish_reason, [pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH])
        self.assertTrue(0 < last.usage.completion_tokens <= 24)
        self.assertGreater(last.moe.assignments, 0)
        self.assertGreater(last.moe.dropped, 0, "gamma 0.75 dropped nothing")
        self.assertEqual(self.stub.Chat(request, timeout=300).text, text, "stream and unary differ")

    def test_rank_zero_runs_on_its_gpu(self):
        info = self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        self.assertEqual(info.ranks, NP)
        self.assertEqual(sum(info.experts_per_rank), info.model.num_experts)
        start = [line for line in self.server.log if "capserve: serving" in line]
        self.assertTrue(start and f", {NP} ranks on cuda:0," in start[0], start)

    def test_start_up_reports_each_ranks_device_memory(self):
        for r in range(NP):
            line = [x for x in self.server.log if x.startswith(f"capserve: rank {r} on cuda:{r}: ")]
            self.assertEqual(len(line), 1, self.server.log[:20])
            m = re.search(r"([\d.]+) MB \([\d.]+ MiB\) of weights, ([\d.]+) MB \([\d.]+ MiB\) of KV cache", line[0])
            self.assertIsNotNone(m, line[0])
            self.assertGreater(float(m.group(1)), 0, line[0])
            self.assertGreater(float(m.group(2)), 0, line[0])


class CudaEmuOutOfMemoryTest(unittest.TestCase):
    def test_a_model_that_does_not_fit_fails_with_a_clear_line_per_rank(self):
        cmd = ["bash", LAUNCH, str(NP), BIN, "--model", MODEL, "--port", "0", "--metrics-port", "0",
               "--threads", "1", "--device", "cuda"]
        env = dict(os.environ, CAPSERVE_CUDA_EMU_DEVICE_MEMORY_MIB="1")  # 1 MiB per emulated GPU
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
                              env=env)
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        print(f"e2e: out of memory -> exit {done.returncode}:\n{done.stdout}", file=sys.stderr)
        self.assertEqual(done.returncode, 1, lines)
        # One line per rank (mpirun forwards the ranks' output in no fixed order), naming its GPU and the sizes.
        for r in range(NP):
            prefix = "capserve: " if r == 0 else f"capserve: rank {r}: "
            self.assertTrue(any(line.startswith(f"{prefix}out of device memory on cuda:{r}: ") and
                                "MiB more needed" in line for line in lines), lines)
        self.assertFalse(any("serving" in line or "MPI_ABORT" in line for line in lines))


if __name__ == "__main__":
    main()
