"""capserve --device cuda on 2 ranks, built against the CUDA emulation (tests/cuda_emu: the very sources of
capserve over the emulated CUDA runtime, cuBLAS and the NCCL stand-in, a GPU per rank): a streamed chat is
served with its MoE statistics, which with a capacity factor below 1 show dropped assignments."""

from capserve_e2e import NP, ServerTestCase, chat_request, main, pb

PROMPT = "Tell me about the mixture of experts."


class CudaEmuChatTest(ServerTestCase):
    FLAGS = ["--device", "cuda", "--capacity-factor", "0.75", "--capacity-policy", "drop"]

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
        self.assertTrue(start and start[0].rstrip().endswith(f"{NP} ranks on cuda:0"), start)


if __name__ == "__main__":
    main()
