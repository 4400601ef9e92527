// capserve-loadgen's pure parts: trace timestamps and slicing, Poisson arrivals, request sizes, corpus
// prompts, the Prometheus text reader and the server figures made from two scrapes, percentiles, the HTTP
// scrape against a local socket, and the RSS verdict.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>

#include "runtime/tokenizer/utf8.h"
#include "tools/loadgen/arrivals.h"
#include "tools/loadgen/http_get.h"
#include "tools/loadgen/latency_stats.h"
#include "tools/loadgen/prometheus_text.h"
#include "tools/loadgen/prompts.h"
#include "tools/loadgen/rss_sampler.h"
#include "tools/loadgen/server_figures.h"

namespace capserve::loadgen {
namespace {

// A directory under the system temporary directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            ("loadgen_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  [[nodiscard]] std::filesystem::path write(const std::string& name, const std::string& text) const {
    const std::filesystem::path p = path_ / name;
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

TEST(TraceTimestamp, DifferencesAcrossSecondsDaysAndMonths) {
  EXPECT_NEAR(parse_trace_timestamp("2023-11-16 18:17:04.0319600") -
                  parse_trace_timestamp("2023-11-16 18:17:03.9799600"),
              0.052, 1e-6);
  EXPECT_NEAR(parse_trace_timestamp("2023-12-01 00:00:00.5") - parse_trace_timestamp("2023-11-30 23:59:59.5"),
              1.0, 1e-9);
  EXPECT_DOUBLE_EQ(parse_trace_timestamp("1970-01-02 00:00:00"), 86400.0);
}

TEST(TraceTimestamp, RejectsMalformedText) {
  for (const char* bad : {"", "2023-11-16", "2023-11-16 18:17", "2023/11/16 18:17:03", "2023-13-16 18:17:03",
                          "2023-11-16 18:17:03.5x"}) {
    EXPECT_THROW(parse_trace_timestamp(bad), std::invalid_argument) << bad;
  }
}

TEST(AzureTrace, ReadsSortsAndMakesTimesRelative) {
  TempDir dir;
  const auto path = dir.write("t.csv",
                              "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                              "2023-11-16 18:17:05.0,30,3\r\n"
                              "2023-11-16 18:17:03.5,10,1\r\n"
                              "\r\n"
                              "2023-11-16 18:17:04.0,20,2\r\n");
  const std::vector<TraceRecord> rows = read_azure_trace(path);
  ASSERT_EQ(rows.size(), 3U);
  EXPECT_DOUBLE_EQ(rows[0].t_s, 0.0);
  EXPECT_EQ(rows[0].context_tokens, 10);
  EXPECT_NEAR(rows[1].t_s, 0.5, 1e-9);
  EXPECT_NEAR(rows[2].t_s, 1.5, 1e-9);
  EXPECT_EQ(rows[2].generated_tokens, 3);
}

TEST(AzureTrace, NamesTheBadLine) {
  TempDir dir;
  const auto path = dir.write("bad.csv",
                              "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:05.0,30,3\n"
                              "2023-11-16 18:17:06.0,-4,3\n");
  try {
    read_azure_trace(path);
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.csv:3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_azure_trace(dir.write("empty.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n")),
               std::runtime_error);
  EXPECT_THROW(read_azure_trace(dir.path() / "missing.csv"), std::runtime_error);
}

TEST(AzureTrace, ReadsTheRealCodeTrace) {
  const std::filesystem::path path =
      std::filesystem::path(CAPSERVE_SOURCE_DIR) / "../shared/data/traces/azure_llm_2023_code.csv";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no " << path;
  const std::vector<TraceRecord> rows = read_azure_trace(path);
  EXPECT_EQ(rows.size(), 8819U);
  EXPECT_GT(rows.back().t_s, 50 * 60.0);  // about 57 minutes
  EXPECT_LT(rows.back().t_s, 60 * 60.0);
}

TEST(TraceSlice, StartDurationAndScale) {
  std::vector<TraceRecord> trace;
  for (int i = 0; i < 100; ++i) trace.push_back({static_cast<double>(i), i, 2 * i, {}});
  // Trace seconds [10, 30) replayed twice as fast: 20 requests over 10 s of run time.
  const std::vector<Arrival> a = slice_trace(trace, {10, 10, 0.5, 0});
  ASSERT_EQ(a.size(), 20U);
  EXPECT_DOUBLE_EQ(a.front().at_s, 0.0);
  EXPECT_EQ(a.front().context_tokens, 10);
  EXPECT_DOUBLE_EQ(a.back().at_s, 9.5);
  EXPECT_EQ(a.back().generated_tokens, 58);
  EXPECT_EQ(slice_trace(trace, {10, 10, 0.5, 5}).size(), 5U);
  EXPECT_EQ(slice_trace(trace, {90, 0, 1, 0}).size(), 10U);  // duration 0: to the end
  EXPECT_THROW(slice_trace(trace, {0, 0, 0, 0}), std::invalid_argument);
}

TEST(Poisson, SeededRateAndBounds) {
  SizeSource sizes({}, 7, 9, 1);
  const std::vector<Arrival> a = poisson_arrivals({5, 2000, 0, 3}, sizes);
  EXPECT_NEAR(static_cast<double>(a.size()) / 2000, 5.0, 0.25);
  for (std::size_t i = 1; i < a.size(); ++i) ASSERT_GE(a[i].at_s, a[i - 1].at_s);
  EXPECT_LT(a.back().at_s, 2000);
  EXPECT_EQ(a.front().context_tokens, 7);
  EXPECT_EQ(a.front().generated_tokens, 9);
  SizeSource again({}, 7, 9, 1);
  const std::vector<Arrival> b = poisson_arrivals({5, 2000, 0, 3}, again);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_DOUBLE_EQ(a[100].at_s, b[100].at_s);
  EXPECT_EQ(poisson_arrivals({5, 2000, 10, 3}, sizes).size(), 10U);
  EXPECT_THROW(poisson_arrivals({0, 10, 0, 1}, sizes), std::invalid_argument);
}

TEST(SizeSource, DrawsRowsOfTheTrace) {
  SizeSource sizes({{0, 11, 1, {}}, {1, 22, 2, {}}}, 7, 9, 5);
  std::map<std::int64_t, int> seen;
  for (int i = 0; i < 200; ++i) {
    Arrival a;
    sizes.draw(a);
    ASSERT_EQ(a.generated_tokens * 11, a.context_tokens);
    ++seen[a.context_tokens];
  }
  EXPECT_EQ(seen.size(), 2U);
}

TEST(Prompts, BurstsAreRunsOfOneDomain) {
  TempDir dir;
  std::string a, b;
  for (int i = 0; i < 500; ++i) a += "alpha beta gamma ";
  for (int i = 0; i < 500; ++i)
    b += "\xCE\xB1\xCE\xB2 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80 ";  // αβ 日本 😀
  b += "\xFF\xFE bad bytes";
  (void)dir.write("a.txt", a);
  (void)dir.write("b.txt", b);
  PromptSource source({dir.path(), {"a", "b"}, PromptMix::bursts, 4, 9, 4}, nullptr);
  std::vector<std::string> domains;
  for (int i = 0; i < 24; ++i) {
    const Prompt p = source.next(16);
    EXPECT_TRUE(runtime::utf8::is_valid(p.text));
    EXPECT_GE(p.text.size(), 60U);
    EXPECT_LE(p.text.size(), 70U);
    EXPECT_TRUE(p.ids.empty());
    domains.push_back(p.domain);
  }
  for (std::size_t run = 0; run < domains.size(); run += 4) {
    for (std::size_t i = 1; i < 4; ++i) EXPECT_EQ(domains[run + i], domains[run]);
    if (run > 0) {
      EXPECT_NE(domains[run], domains[run - 1]);  // two domains: runs alternate
    }
  }
}

TEST(Prompts, MixedUsesEveryDomainAndTokenizerSizesExactly) {
  const std::filesystem::path model =
      std::filesystem::path(CAPSERVE_SOURCE_DIR) / "deploy/models/capserve-moe-tiny";
  const std::filesystem::path corpus = std::filesystem::path(CAPSERVE_SOURCE_DIR) / "../shared/data/corpus";
  if (!std::filesystem::exists(model / "tokenizer.json") || !std::filesystem::exists(corpus / "code.txt"))
    GTEST_SKIP() << "no default model or corpus";
  const runtime::Tokenizer tokenizer = runtime::Tokenizer::load(model);
  PromptSource source({corpus, {"code", "wikipedia"}, PromptMix::mixed, 1, 3, 4}, &tokenizer);
  std::map<std::string, int> seen;
  for (int i = 0; i < 40; ++i) {
    const Prompt p = source.next(100);
    ASSERT_EQ(p.ids.size(), 100U);
    EXPECT_TRUE(runtime::utf8::is_valid(p.text));
    ++seen[p.domain];
  }
  EXPECT_EQ(seen.size(), 2U);
}

TEST(Prompts, MissingCorpusFileIsNamed) {
  TempDir dir;
  try {
    PromptSource source({dir.path(), {"nope"}, PromptMix::mixed, 1, 1, 4}, nullptr);
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("nope.txt"), std::string::npos);
  }
}

TEST(PrometheusText, ReadsTheExpositionFormat) {
  const Scrape s = parse_prometheus_text(
      "# HELP capserve_x_total Help with \"quotes\".\n"
      "# TYPE capserve_x_total counter\n"
      "capserve_x_total{layer=\"0\"} 3\n"
      "capserve_x_total{layer=\"1\",phase=\"a\\\"b\\\\c\\nd\"} 4.5e2 1700000000000\r\n"
      "  capserve_g 7\n"
      "capserve_h_bucket{le=\"+Inf\"} 12\n"
      "capserve_nan NaN\n"
      "capserve_neg -Inf\n"
      "this is not a sample\n"
      "capserve_bad{layer=\"0} 1\n"
      "\n");
  EXPECT_EQ(s.unreadable_lines, 2U);
  ASSERT_EQ(s.samples.size(), 6U);
  EXPECT_EQ(s.samples[1].labels.at("phase"), "a\"b\\c\nd");
  EXPECT_DOUBLE_EQ(*s.sum("capserve_x_total"), 453);
  EXPECT_DOUBLE_EQ(*s.sum("capserve_x_total", {{"layer", "1"}}), 450);
  EXPECT_FALSE(s.sum("capserve_missing").has_value());
  EXPECT_DOUBLE_EQ(*s.sum("capserve_g"), 7);
  EXPECT_DOUBLE_EQ(s.by_label("capserve_h_bucket", "le").at("+Inf"), 12);
  EXPECT_TRUE(std::isnan(*s.sum("capserve_nan")));
  EXPECT_TRUE(std::isinf(*s.sum("capserve_neg")));
}

TEST(ServerFigures, DeltasGaugesAndRunImbalance) {
  const Scrape before = parse_prometheus_text(
      "capserve_moe_dropped_assignments_total{layer=\"0\"} 5\n"
      "capserve_moe_dropped_assignments_total{layer=\"1\"} 5\n"
      "capserve_moe_rank_tokens_total{layer=\"0\",rank=\"0\"} 100\n"
      "capserve_moe_rank_tokens_total{layer=\"0\",rank=\"1\"} 100\n"
      "capserve_moe_rank_imbalance_ratio_sum 10\n"
      "capserve_moe_rank_imbalance_ratio_count 8\n"
      "capserve_predictor_step_load_cosine_sum 2.5\n"
      "capserve_predictor_step_load_cosine_count 3\n"
      "capserve_batch_selector_step_imbalance_ratio_sum{kind=\"predicted\"} 4\n"
      "capserve_batch_selector_step_imbalance_ratio_count{kind=\"predicted\"} 3\n"
      "capserve_request_errors_total{code=\"UNAVAILABLE\"} 1\n"
      "capserve_requests_total{finish_reason=\"length\"} 2\n");
  const Scrape after = parse_prometheus_text(
      "capserve_moe_dropped_assignments_total{layer=\"0\"} 7\n"
      "capserve_moe_dropped_assignments_total{layer=\"1\"} 9\n"
      "capserve_moe_rank_tokens_total{layer=\"0\",rank=\"0\"} 130\n"
      "capserve_moe_rank_tokens_total{layer=\"0\",rank=\"1\"} 110\n"
      "capserve_moe_rank_imbalance{layer=\"0\"} 1.25\n"
      "capserve_moe_rank_imbalance_ratio_sum 13\n"
      "capserve_moe_rank_imbalance_ratio_count 10\n"
      "capserve_predictor_load_cosine 0.5\n"
      "capserve_predictor_step_load_cosine_sum 4.25\n"
      "capserve_predictor_step_load_cosine_count 5\n"
      "capserve_batch_selector_step_imbalance_ratio_sum{kind=\"predicted\"} 6.5\n"
      "capserve_batch_selector_step_imbalance_ratio_count{kind=\"predicted\"} 5\n"
      "capserve_batch_selector_step_imbalance_ratio_sum{kind=\"realized\"} 3\n"
      "capserve_batch_selector_step_imbalance_ratio_count{kind=\"realized\"} 2\n"
      "capserve_request_errors_total{code=\"UNAVAILABLE\"} 1\n"
      "capserve_request_errors_total{code=\"CANCELLED\"} 2\n"
      "capserve_requests_total{finish_reason=\"length\"} 12\n");
  const ServerFigures f = server_figures(before, after);
  EXPECT_DOUBLE_EQ(*f.dropped, 6);
  EXPECT_FALSE(f.rerouted.has_value());
  EXPECT_DOUBLE_EQ(f.imbalance_run_by_layer.at("0"), 30.0 / 20.0);  // ranks did 30 and 10 tokens
  EXPECT_DOUBLE_EQ(f.imbalance_last_by_layer.at("0"), 1.25);
  EXPECT_DOUBLE_EQ(*f.imbalance_mean, 1.5);
  // Means over the run's steps from the histograms, not the last step's gauge.
  EXPECT_DOUBLE_EQ(*f.predictor_cosine, 1.75 / 2);
  EXPECT_DOUBLE_EQ(*f.selector_predicted_imbalance, 2.5 / 2);
  EXPECT_DOUBLE_EQ(*f.selector_realized_imbalance, 1.5);
  EXPECT_FALSE(f.selector_decisions.has_value());
  EXPECT_EQ(f.errors_by_code.size(), 1U);
  EXPECT_DOUBLE_EQ(f.errors_by_code.at("CANCELLED"), 2);
  EXPECT_DOUBLE_EQ(f.requests_by_finish_reason.at("length"), 10);
}

TEST(LatencyStats, NearestRankPercentiles) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);
  const Distribution d = summarize(v);
  EXPECT_EQ(d.count, 100U);
  EXPECT_DOUBLE_EQ(d.p50, 50);
  EXPECT_DOUBLE_EQ(d.p90, 90);
  EXPECT_DOUBLE_EQ(d.p99, 99);
  EXPECT_DOUBLE_EQ(d.max, 100);
  EXPECT_DOUBLE_EQ(d.mean, 50.5);
  EXPECT_DOUBLE_EQ(summarize({4}).p99, 4);
  EXPECT_EQ(summarize({}).count, 0U);
}

TEST(HttpUrl, Parses) {
  const Url u = parse_http_url("http://localhost:9400/metrics");
  EXPECT_EQ(u.host, "localhost");
  EXPECT_EQ(u.port, "9400");
  EXPECT_EQ(u.path, "/metrics");
  const Url v = parse_http_url("http://[::1]:81");
  EXPECT_EQ(v.host, "::1");
  EXPECT_EQ(v.port, "81");
  EXPECT_EQ(v.path, "/");
  EXPECT_EQ(parse_http_url("http://example").port, "80");
  EXPECT_THROW(parse_http_url("https://localhost/metrics"), std::invalid_argument);
  EXPECT_THROW(parse_http_url("http://:80/"), std::invalid_argument);
}

// Serves one canned response on a loopback port.
class OneShotServer {
 public:
  explicit OneShotServer(std::string response) : response_(std::move(response)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd_, 1) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
      throw std::runtime_error("cannot listen");
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      char buffer[4096];
      std::string request;
      while (request.find("\r\n\r\n") == std::string::npos) {
        const ssize_t n = ::recv(c, buffer, sizeof buffer, 0);
        if (n <= 0) break;
        request.append(buffer, static_cast<std::size_t>(n));
      }
      (void)::send(c, response_.data(), response_.size(), MSG_NOSIGNAL);
      ::close(c);
    });
  }
  ~OneShotServer() {
    thread_.join();
    ::close(fd_);
  }
  OneShotServer(const OneShotServer&) = delete;
  OneShotServer& operator=(const OneShotServer&) = delete;
  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/metrics"; }

 private:
  std::string response_;
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

TEST(HttpGet, ContentLengthChunkedAndErrors) {
  {
    OneShotServer s("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello");
    EXPECT_EQ(http_get(s.url(), std::chrono::seconds(5)), "hello");
  }
  {
    OneShotServer s(
        "HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n");
    EXPECT_EQ(http_get(s.url(), std::chrono::seconds(5)), "hello world");
  }
  {
    OneShotServer s("HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
    try {
      (void)http_get(s.url(), std::chrono::seconds(5));
      FAIL() << "no exception";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("404"), std::string::npos) << e.what();
    }
  }
}

TEST(Rss, ReadsOwnMemoryAndJudgesSeries) {
  const std::optional<std::int64_t> own = read_vm_rss_kib(::getpid());
  ASSERT_TRUE(own.has_value());
  EXPECT_GT(*own, 0);
  EXPECT_GE(read_proc_status(::getpid(), "Threads").value_or(0), 1);
  EXPECT_FALSE(read_proc_status(::getpid(), "NoSuchKey").has_value());
  std::vector<RssSeries> series;
  series.push_back(
      {1, {0, 30, 60, 90, 120}, {100, 1000, 1000, 1010, 1000}, {}, std::nullopt});  // warm-up, then flat
  series.push_back({2, {0, 30, 60, 90, 120}, {1000, 1000, 1000, 1200, 1400}, {}, std::nullopt});  // growing
  series.push_back({3, {0, 30}, {1000, 1000}, {}, 60.0});                                         // exited
  const std::vector<RssVerdict> v = judge_rss(series, 60, 1e9, 5);
  ASSERT_EQ(v.size(), 3U);
  EXPECT_TRUE(v[0].flat);
  EXPECT_EQ(v[0].at_warmup_kib, 1000);
  EXPECT_EQ(v[0].max_kib, 1010);
  EXPECT_FALSE(v[1].flat);
  EXPECT_DOUBLE_EQ(v[1].growth_pct, 40);
  EXPECT_NEAR(v[1].slope_kib_per_min, 400, 1e-6);
  EXPECT_TRUE(v[2].exited);
  EXPECT_FALSE(v[2].flat);
  // Growth during the load is not hidden by the drop after it.
  const std::vector<RssSeries> dropped{
      {4, {0, 60, 120, 180, 200}, {500, 1000, 1100, 1200, 900}, {}, std::nullopt}};
  const RssVerdict d = judge_rss(dropped, 60, 180, 5).front();
  EXPECT_EQ(d.last_kib, 1200);
  EXPECT_DOUBLE_EQ(d.growth_pct, 20);
  EXPECT_FALSE(d.flat);
}

}  // namespace
}  // namespace capserve::loadgen
