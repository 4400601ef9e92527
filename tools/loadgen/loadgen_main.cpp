// capserve-loadgen: drives a live CapServe with streamed requests and reports what clients see (TTFT,
// inter-token and end-to-end latency, throughput, one terminal status per request) next to what the server
// says about itself on /metrics (dropped and rerouted assignments, per-rank imbalance, predictor accuracy).
//
// Arrivals: a replayed trace (Azure LLM CSV or Mooncake JSONL; time-scaled slice), a seeded Poisson process,
// or a closed loop that keeps N streams open. Sizes: the trace's, times --length-scale, capped to the limits
// and the served context (and the report says how many were capped, by how much). Prompts: random slices of
// the domain corpus, in semantic bursts or mixed; for a Mooncake trace, token ids whose shared prefixes
// follow its hash_ids (prefix_tokens.h). --write-trace writes the scaled, capped slice as Mooncake JSONL for
// another client (AIPerf) and sends nothing. Every request is a gRPC callback reactor, so a few threads
// sustain hundreds of streams. Exit status: 0 when every request got exactly one terminal status (LOST = 0)
// and the stream contract held; 1 otherwise; 3 with --fail-on-error when any status was not OK; 4 with
// --soak-report when a server process exited or its memory grew past the tolerance after warm-up.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/cli/flag_checks.h"
#include "runtime/cli/version.h"
#include "runtime/tokenizer/tokenizer.h"
#include "tools/loadgen/arrivals.h"
#include "tools/loadgen/http_get.h"
#include "tools/loadgen/mooncake_trace.h"
#include "tools/loadgen/prefix_tokens.h"
#include "tools/loadgen/prometheus_text.h"
#include "tools/loadgen/prompts.h"
#include "tools/loadgen/report.h"
#include "tools/loadgen/rss_sampler.h"
#include "tools/loadgen/server_figures.h"
#include "tools/loadgen/stream_client.h"
#include "tools/loadgen/trace_lengths.h"

namespace {

using namespace capserve::loadgen;
namespace v1 = capserve::v1;

std::atomic<bool> g_interrupted{false};

// The first SIGINT/SIGTERM stops sending and drains; a second one ends the program at once.
extern "C" void on_interrupt(int signal) {
  g_interrupted.store(true);
  std::signal(signal, SIG_DFL);
}

struct Options {
  std::string target = "localhost:50051";
  std::string mode = "chat";
  std::string model;
  // Arrivals.
  std::string trace;
  std::string trace_format = "auto";
  double length_scale = 1;
  std::int64_t max_context = 0;
  std::string write_trace;
  double time_scale = 1;
  double trace_start_s = 0;
  double duration_s = 60;
  std::int64_t max_requests = 0;
  double rate = 0;
  std::int64_t concurrency = 0;
  std::uint64_t seed = 1;
  // Prompts and sizes.
  // In the source tree known at build time, so that the tool runs from any directory.
  std::string corpus = CAPSERVE_SOURCE_DIR "/../shared/data/corpus";
  std::vector<std::string> domains = capserve::loadgen::kCorpusDomains;
  std::string prompt_mix = "bursts";
  std::int64_t burst_length = 16;
  std::string tokenizer;
  double bytes_per_token = 4;
  std::int64_t prompt_tokens = 128;
  std::int64_t output_tokens = 64;
  std::int64_t max_prompt_tokens = 512;
  std::int64_t max_tokens = 128;
  float temperature = 0;
  float top_p = 0;
  std::uint32_t top_k = 0;
  bool ignore_eos = false;
  double deadline_s = 0;
  // Running and reporting.
  double connect_timeout_s = 30;
  double drain_timeout_s = 120;
  double progress_s = 10;
  std::string metrics_url;
  std::string json_path;
  bool per_request = false;
  bool fail_on_error = false;
  // Soak.
  bool soak = false;
  std::vector<int> server_pids;
  std::string server_name = "capserve";
  double soak_interval_s = 5;
  double soak_warmup_s = 60;
  double rss_tolerance_pct = 5;
};

void add_flags(CLI::App& app, Options& o) {
  app.add_option("--target", o.target, "server address host:port")->capture_default_str();
  app.add_option("--mode", o.mode,
                 "chat: ChatStream with the prompt as a user message; generate: Generate with "
                 "token ids (needs --tokenizer)")
      ->check(CLI::IsMember({"chat", "generate"}))
      ->capture_default_str();
  app.add_option("--model", o.model, "model name in requests (default: the served model)");

  auto* g = app.add_option_group("arrivals",
                                 "one of: --trace (replay), --rate (Poisson), --concurrency (closed loop)");
  g->add_option(
       "--trace", o.trace,
       "Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens, e.g. "
       "../shared/data/traces/azure_llm_2023_code.csv next to the source tree) or Mooncake JSONL "
       "({timestamp ms, input_length, output_length, hash_ids}, e.g. "
       "../shared/data/traces/mooncake_synthetic.jsonl): replayed, or with --rate/--concurrency only "
       "its request sizes are used")
      ->check(CLI::ExistingFile);
  g->add_option("--trace-format", o.trace_format, "auto: by extension (.jsonl Mooncake, .csv Azure)")
      ->check(CLI::IsMember({"auto", "azure", "mooncake"}))
      ->capture_default_str();
  g->add_option("--length-scale", o.length_scale,
                "multiplies the trace's prompt and output lengths and a Mooncake trace's block size (512 "
                "tokens per hash id): 1/32 = 0.03125 gives 16-token blocks, the server's KV block")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  g->add_option("--max-context", o.max_context,
                "prompt + output cap (default: the served model's max_context; with --write-trace: none)")
      ->check(CLI::NonNegativeNumber);
  g->add_option(
      "--write-trace", o.write_trace,
      "write the scaled, capped, sliced Mooncake trace to this file (JSONL, AIPerf's mooncake_trace; "
      "block size in the report) and send nothing");
  g->add_option("--time-scale", o.time_scale,
                "replay time = trace time * this (0.1 replays ten times faster, 2 half as fast)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  g->add_option("--trace-start-s", o.trace_start_s, "replay from this second of the trace")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  g->add_option("--duration-s", o.duration_s,
                "length of the run (replay: of the scaled slice; 0 = to the trace's end)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  g->add_option("--max-requests", o.max_requests, "stop after this many requests (0: no limit)")
      ->check(CLI::NonNegativeNumber);
  g->add_option("--rate", o.rate, "Poisson arrivals at this many requests per second")
      ->check(CLI::PositiveNumber);
  g->add_option("--concurrency", o.concurrency, "closed loop: keep this many streams open for --duration-s")
      ->check(CLI::PositiveNumber);
  g->add_option("--seed", o.seed, "seeds arrivals, prompt choice and sampling")->capture_default_str();

  auto* p = app.add_option_group("prompts");
  p->add_option("--corpus", o.corpus, "directory of <domain>.txt")
      ->check(CLI::ExistingDirectory)
      ->capture_default_str();
  p->add_option("--domains", o.domains, "corpus domains to draw from")->delimiter(',')->capture_default_str();
  p->add_option("--prompt-mix", o.prompt_mix,
                "bursts: runs of one domain; mixed: a random domain per request")
      ->check(CLI::IsMember({"bursts", "mixed"}))
      ->capture_default_str();
  p->add_option("--burst-length", o.burst_length, "requests per run of one domain")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  p->add_option(
       "--tokenizer", o.tokenizer,
       "directory with the served model's tokenizer.json: prompts then have exactly the asked number of "
       "tokens (else about --bytes-per-token bytes each)")
      ->check(CLI::ExistingDirectory);
  p->add_option("--bytes-per-token", o.bytes_per_token)->check(CLI::PositiveNumber)->capture_default_str();
  p->add_option("--prompt-tokens", o.prompt_tokens, "prompt size without a trace")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  p->add_option("--output-tokens", o.output_tokens, "max_tokens without a trace")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  p->add_option("--max-prompt-tokens", o.max_prompt_tokens, "cap on a trace's (scaled) prompt length")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  p->add_option("--max-tokens", o.max_tokens,
                "cap on a trace's (scaled) output length (max_tokens of each request)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  p->add_option("--temperature", o.temperature, "0: greedy")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  p->add_option("--top-p", o.top_p)->check(CLI::Range(0.0, 1.0));
  p->add_option("--top-k", o.top_k);
  p->add_flag("--ignore-eos", o.ignore_eos, "generate max_tokens tokens whatever the model says");
  p->add_option("--deadline-s", o.deadline_s, "per-request gRPC deadline (0: none)")
      ->check(CLI::NonNegativeNumber);

  auto* r = app.add_option_group("report");
  r->add_option("--connect-timeout-s", o.connect_timeout_s)->capture_default_str();
  r->add_option(
       "--drain-timeout-s", o.drain_timeout_s,
       "after the last arrival, wait this long for every request's terminal status; the rest are LOST")
      ->capture_default_str();
  r->add_option("--progress-s", o.progress_s, "progress line on stderr this often (0: off)")
      ->capture_default_str();
  r->add_option(
      "--metrics-url", o.metrics_url,
      "the server's Prometheus endpoint, e.g. http://localhost:9400/metrics, scraped before and after");
  r->add_option("--json", o.json_path, "write the report as JSON");
  r->add_flag("--per-request", o.per_request, "include every request's record in the JSON");
  r->add_flag("--fail-on-error", o.fail_on_error,
              "exit 3 when any request ended with a status other than OK");

  auto* s = app.add_option_group("soak", "resident memory of the server's processes over the run");
  s->add_flag("--soak-report", o.soak, "sample VmRSS of the server's ranks and judge it flat after warm-up");
  s->add_option("--server-pids", o.server_pids,
                "the ranks' pids (default: the processes called --server-name behind --target's port)")
      ->delimiter(',');
  s->add_option("--server-name", o.server_name)->capture_default_str();
  s->add_option("--soak-interval-s", o.soak_interval_s)->check(CLI::PositiveNumber)->capture_default_str();
  s->add_option("--soak-warmup-s", o.soak_warmup_s, "growth is measured from this second on")
      ->capture_default_str();
  s->add_option("--rss-tolerance-pct", o.rss_tolerance_pct, "growth after warm-up still called flat")
      ->capture_default_str();
}

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::string fixed(double v, int digits) {
  std::ostringstream out;
  out.precision(digits);
  out << std::fixed << v;
  return out.str();
}

std::optional<Scrape> scrape(const std::string& url, std::string& error) {
  try {
    return parse_prometheus_text(http_get(url, std::chrono::seconds(10)));
  } catch (const std::exception& e) {
    error = e.what();
    return std::nullopt;
  }
}

// The scrape after a run, once the server has nothing running or waiting (it records a cancelled request's
// outcome a step or so after the client has its status), or after 5 s (other clients may be using it).
std::optional<Scrape> settled_scrape(const std::string& url, std::string& error) {
  const Clock::time_point give_up = Clock::now() + std::chrono::seconds(5);
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::optional<Scrape> s = scrape(url, error);
    if (!s) return s;
    const double busy =
        s->sum("capserve_requests_running").value_or(0) + s->sum("capserve_requests_waiting").value_or(0);
    if (busy == 0 || Clock::now() >= give_up) return s;
  }
}

nlohmann::json server_info(const std::shared_ptr<grpc::Channel>& channel) {
  const auto stub = v1::Inference::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ServerInfo info;
  const grpc::Status status = stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
  if (!status.ok())
    throw std::runtime_error("GetServerInfo: " + status_code_name(status.error_code()) + ": " +
                             status.error_message());
  return {{"version", info.version()},
          {"ranks", info.ranks()},
          {"model", info.model().id()},
          {"architecture", info.model().architecture()},
          {"max_context", info.model().max_context()},
          {"placement", info.placement()},
          {"capacity", info.capacity()},
          {"batch_selector", info.batch_selector()},
          {"max_running_sequences", info.max_running_sequences()},
          {"max_batched_tokens", info.max_batched_tokens()},
          {"kv_blocks_per_rank", info.kv_blocks_per_rank()}};
}

int port_of(const std::string& target) {
  const std::size_t colon = target.rfind(':');
  try {
    return colon == std::string::npos ? -1 : std::stoi(target.substr(colon + 1));
  } catch (const std::exception&) {
    return -1;
  }
}

// The pids whose memory a soak run samples.
std::vector<int> soak_pids(const Options& o) {
  std::vector<int> pids = o.server_pids;
  if (pids.empty()) pids = find_server_pids(o.server_name, port_of(o.target));
  if (pids.empty())
    throw std::runtime_error("--soak-report: no process called '" + o.server_name + "' listens on " +
                             o.target + " here; give --server-pids");
  std::string list;
  for (const int pid : pids) list += (list.empty() ? "" : ",") + std::to_string(pid);
  std::fprintf(stderr, "capserve-loadgen: sampling VmRSS of pids %s every %.0f s\n", list.c_str(),
               o.soak_interval_s);
  return pids;
}

ClientOptions client_options(const Options& o) {
  return {o.mode == "chat" ? CallMode::chat : CallMode::generate,
          o.model,
          o.temperature,
          o.top_p,
          o.top_k,
          o.seed,
          o.ignore_eos,
          std::chrono::milliseconds(static_cast<std::int64_t>(o.deadline_s * 1000))};
}

std::shared_ptr<grpc::Channel> connect(const Options& o) {
  auto channel =
      grpc::CreateCustomChannel(o.target, grpc::InsecureChannelCredentials(), grpc::ChannelArguments());
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                             std::chrono::duration<double>(o.connect_timeout_s));
  if (!channel->WaitForConnected(deadline))
    throw std::runtime_error("cannot connect to " + o.target + " within " + fixed(o.connect_timeout_s, 0) +
                             " s");
  return channel;
}

// The trace's rows with their lengths scaled (none without --trace).
std::vector<TraceRecord> load_trace(const Options& o, TraceFormat format, std::int64_t block_tokens) {
  if (o.trace.empty()) return {};
  std::vector<TraceRecord> rows = read_trace(o.trace, format);
  scale_lengths(rows, o.length_scale, block_tokens);
  return rows;
}

// One run: arrivals planned up front (or a closed loop), requests started on time, every terminal status
// collected, then the report.
class Run {
 public:
  explicit Run(const Options& o)
      : o_(o),
        closed_loop_(o.concurrency > 0),
        poisson_(!closed_loop_ && o.rate > 0),
        format_(o.trace.empty() ? TraceFormat::azure : trace_format_for(o.trace, o.trace_format)),
        block_tokens_(scaled_block_tokens(kMooncakeBlockTokens, o.length_scale)),
        trace_(load_trace(o, format_, block_tokens_)),
        tokenizer_(o.tokenizer.empty() ? std::nullopt
                                       : std::optional(capserve::runtime::Tokenizer::load(o.tokenizer))),
        prompts_({o.corpus, o.domains, o.prompt_mix == "mixed" ? PromptMix::mixed : PromptMix::bursts,
                  o.burst_length, o.seed, o.bytes_per_token},
                 tokenizer_ ? &*tokenizer_ : nullptr),
        sizes_(closed_loop_ || poisson_ ? trace_ : std::vector<TraceRecord>{}, o.prompt_tokens,
               o.output_tokens, o.seed + 1) {
    if (format_ == TraceFormat::mooncake && tokenizer_)
      prefix_.emplace(ordinary_token_ids(*tokenizer_), block_tokens_, o.seed);
  }

  int execute() {
    const std::vector<Arrival> arrivals = plan_arrivals();
    if (!o_.write_trace.empty()) return write_trace(arrivals);
    const auto channel = connect(o_);
    Report report;
    const nlohmann::json info = server_info(channel);
    caps_ = LengthCaps({o_.max_prompt_tokens, o_.max_tokens,
                        o_.max_context > 0 ? o_.max_context : info.value("max_context", std::int64_t{0})});
    if (!closed_loop_) {
      LengthCaps preview = caps_;
      for (const Arrival& a : arrivals) preview.fit(a.context_tokens, a.generated_tokens);
      std::fprintf(stderr, "capserve-loadgen: %s\n", preview.summary().c_str());
    }
    report.run = describe(info);

    std::optional<Scrape> before;
    if (!o_.metrics_url.empty()) {
      before = scrape(o_.metrics_url, report.server_error);
      if (!before) std::fprintf(stderr, "capserve-loadgen: warning: %s\n", report.server_error.c_str());
    }
    std::optional<RssSampler> sampler;
    if (o_.soak)
      sampler.emplace(soak_pids(o_),
                      std::chrono::milliseconds(static_cast<std::int64_t>(o_.soak_interval_s * 1000)));

    std::signal(SIGINT, on_interrupt);
    std::signal(SIGTERM, on_interrupt);
    t0_ = Clock::now();
    next_progress_ = t0_ + seconds(o_.progress_s);
    StreamClient client(channel, client_options(o_), t0_);
    if (closed_loop_) {
      keep_streams_open(client);
    } else {
      replay(client, arrivals);
    }
    const double load_end_s = sampler ? sampler->elapsed_s() : 0;
    if (g_interrupted.load())
      std::fprintf(stderr, "capserve-loadgen: interrupted; waiting for requests in flight\n");
    const StreamClient::Abandoned abandoned = drain(client);

    if (before) {
      if (const std::optional<Scrape> after = settled_scrape(o_.metrics_url, report.server_error))
        report.server = server_figures(*before, *after);
    }
    if (sampler) {
      sampler->stop();
      SoakFigures soak{o_.soak_warmup_s, load_end_s, o_.rss_tolerance_pct, sampler->series(), {}};
      soak.verdicts = judge_rss(soak.series, o_.soak_warmup_s, load_end_s, o_.rss_tolerance_pct);
      report.soak = std::move(soak);
    }
    report.client = client_figures(records_, sent_, abandoned.unterminated, client.max_in_flight());
    report.run["length_caps"] = caps_.to_json();
    report.run["length_caps_summary"] = caps_.summary();
    print_report(report);
    if (!o_.json_path.empty()) {
      std::ofstream out(o_.json_path);
      out << to_json(report, o_.per_request ? &records_ : nullptr).dump(2) << "\n";
      if (!out) throw std::runtime_error("cannot write " + o_.json_path);
    }
    if (abandoned.unterminated > 0) {
      std::fflush(stdout);
      std::_Exit(1);  // gRPC still owns those calls: the client cannot be torn down safely
    }
    return exit_status(report);
  }

 private:
  std::vector<Arrival> plan_arrivals() {
    if (!closed_loop_ && !poisson_ && o_.trace.empty())
      throw std::invalid_argument("say how requests arrive: --trace FILE, --rate R or --concurrency N");
    if (o_.mode == "generate" && !tokenizer_)
      throw std::invalid_argument(
          "--mode generate needs --tokenizer (the model directory) to make token ids");
    if (format_ == TraceFormat::mooncake && o_.write_trace.empty() && o_.mode != "generate")
      throw std::invalid_argument(
          "a Mooncake trace is sent as token ids with shared prefixes: give --mode generate and --tokenizer "
          "(the model directory: its vocabulary and special tokens)");
    std::vector<Arrival> arrivals;
    if (closed_loop_) {
      arrivals_text_ = "closed loop of " + std::to_string(o_.concurrency) + " streams for " +
                       fixed(o_.duration_s, 0) + " s";
    } else if (poisson_) {
      arrivals = poisson_arrivals({o_.rate, o_.duration_s, o_.max_requests, o_.seed}, sizes_);
      arrivals_text_ = "Poisson " + fixed(o_.rate, 2) + " req/s for " + fixed(o_.duration_s, 0) + " s (" +
                       std::to_string(arrivals.size()) + " requests)";
    } else {
      arrivals = slice_trace(trace_, {o_.trace_start_s, o_.duration_s, o_.time_scale, o_.max_requests});
      const double span = arrivals.empty() ? 0 : arrivals.back().at_s;
      arrivals_text_ = "trace " + std::filesystem::path(o_.trace).filename().string() + " from " +
                       fixed(o_.trace_start_s, 0) + " s x" + fixed(o_.time_scale, 3) + " (" +
                       std::to_string(arrivals.size()) + " requests over " + fixed(span, 1) + " s)";
      if (arrivals.empty())
        throw std::invalid_argument("the trace slice holds no request: " + arrivals_text_);
    }
    if ((closed_loop_ || poisson_) && !trace_.empty())
      arrivals_text_ += ", sizes from " + std::filesystem::path(o_.trace).filename().string();
    if (!trace_.empty() && o_.length_scale != 1) arrivals_text_ += ", lengths x" + fixed(o_.length_scale, 5);
    if (format_ == TraceFormat::mooncake && !trace_.empty())
      arrivals_text_ += ", prefixes of " + std::to_string(block_tokens_) + "-token blocks";
    return arrivals;
  }

  // --write-trace: the arrivals as a Mooncake trace with the sizes they would be sent with.
  int write_trace(const std::vector<Arrival>& arrivals) {
    if (format_ != TraceFormat::mooncake || closed_loop_)
      throw std::invalid_argument(
          "--write-trace writes the arrivals of a Mooncake trace (--trace FILE.jsonl, "
          "replayed or with --rate)");
    LengthCaps caps({o_.max_prompt_tokens, o_.max_tokens, o_.max_context});
    std::vector<std::int64_t> prompt;
    std::vector<std::int64_t> output;
    for (const Arrival& a : arrivals) {
      const Lengths l = caps.fit(a.context_tokens, a.generated_tokens);
      prompt.push_back(l.prompt);
      output.push_back(l.output);
    }
    std::ofstream out(o_.write_trace);
    write_mooncake_trace(out, arrivals, prompt, output, block_tokens_);
    out.close();
    if (!out) throw std::runtime_error("cannot write " + o_.write_trace);
    std::printf("capserve-loadgen: wrote %s: %s; block size %lld tokens; %s\n", o_.write_trace.c_str(),
                arrivals_text_.c_str(), static_cast<long long>(block_tokens_), caps.summary().c_str());
    return 0;
  }

  nlohmann::json describe(nlohmann::json server) const {
    nlohmann::json run = {{"target", o_.target},
                          {"mode", o_.mode},
                          {"arrivals", arrivals_text_},
                          {"trace_format", o_.trace.empty()                   ? ""
                                           : format_ == TraceFormat::mooncake ? "mooncake"
                                                                              : "azure"},
                          {"length_scale", o_.length_scale},
                          {"block_tokens", format_ == TraceFormat::mooncake ? block_tokens_ : 0},
                          {"prompt_mix", o_.prompt_mix},
                          {"burst_length", o_.burst_length},
                          {"domains", o_.domains},
                          {"max_prompt_tokens", o_.max_prompt_tokens},
                          {"max_tokens", o_.max_tokens},
                          {"temperature", o_.temperature},
                          {"seed", o_.seed},
                          {"tokenizer", o_.tokenizer},
                          {"server_info", std::move(server)}};
    const std::string prompts =
        prefix_ ? "token-id prompts sharing the trace's prefixes"
                : "prompts " + o_.prompt_mix +
                      (o_.prompt_mix == "bursts" ? " of " + std::to_string(o_.burst_length) : "");
    run["summary"] = arrivals_text_ + "; " + o_.mode + ", " + prompts +
                     ", prompt <= " + std::to_string(o_.max_prompt_tokens) +
                     " tokens, max_tokens <= " + std::to_string(o_.max_tokens) +
                     (o_.temperature > 0 ? ", temperature " + fixed(o_.temperature, 2) : ", greedy");
    return run;
  }

  RequestSpec spec_for(const Arrival& a) {
    RequestSpec spec;
    spec.index = static_cast<std::uint64_t>(sent_);
    spec.scheduled_s = a.at_s;
    const Lengths lengths = caps_.fit(a.context_tokens, a.generated_tokens);
    spec.prompt_tokens_target = lengths.prompt;
    spec.max_tokens = lengths.output;
    if (prefix_) {
      spec.domain = "mooncake";
      spec.ids = prefix_->prompt(a.hash_ids, lengths.prompt);
      return spec;
    }
    Prompt p = prompts_.next(spec.prompt_tokens_target);
    spec.domain = std::move(p.domain);
    spec.text = std::move(p.text);
    spec.ids = std::move(p.ids);
    return spec;
  }

  // Open loop: each request at its time (its prompt made while waiting for it).
  void replay(StreamClient& client, const std::vector<Arrival>& arrivals) {
    for (const Arrival& a : arrivals) {
      RequestSpec spec = spec_for(a);
      const Clock::time_point at = t0_ + seconds(a.at_s);
      while (!g_interrupted.load() && Clock::now() < at) {
        std::this_thread::sleep_until(std::min(at, Clock::now() + std::chrono::milliseconds(500)));
        poll(client);
      }
      if (g_interrupted.load()) return;
      client.start(std::move(spec));
      ++sent_;
      poll(client);
    }
  }

  // Closed loop: a new request whenever fewer than --concurrency are open.
  void keep_streams_open(StreamClient& client) {
    const Clock::time_point end = t0_ + seconds(o_.duration_s);
    while (!g_interrupted.load() && Clock::now() < end && (o_.max_requests == 0 || sent_ < o_.max_requests)) {
      const Clock::time_point wake = std::min(end, Clock::now() + std::chrono::seconds(1));
      if (client.wait_below(o_.concurrency, wake) < o_.concurrency) {
        Arrival a{std::chrono::duration<double>(Clock::now() - t0_).count(), 0, 0, {}};
        sizes_.draw(a);
        client.start(spec_for(a));
        ++sent_;
      }
      poll(client);
    }
  }

  // Every request must end with a status: they get until the drain timeout, then the rest are LOST.
  StreamClient::Abandoned drain(StreamClient& client) {
    const Clock::time_point end = Clock::now() + seconds(o_.drain_timeout_s);
    while (client.wait_below(1, std::min(end, Clock::now() + std::chrono::seconds(1))) > 0 &&
           Clock::now() < end)
      poll(client);
    StreamClient::Abandoned abandoned;
    if (client.in_flight() > 0) {
      std::fprintf(stderr,
                   "capserve-loadgen: %lld requests still without a terminal status after %.0f s: LOST\n",
                   static_cast<long long>(client.in_flight()), o_.drain_timeout_s);
      abandoned = client.abandon_in_flight(std::chrono::seconds(10));
    }
    poll(client);
    return abandoned;
  }

  int exit_status(const Report& report) const {
    const ClientFigures& c = report.client;
    if (c.lost > 0 || c.protocol_errors > 0) return 1;
    if (o_.fail_on_error && c.ok != c.sent) return 3;
    if (report.soak) {
      for (const RssVerdict& v : report.soak->verdicts) {
        if (!v.flat) return 4;
      }
    }
    return 0;
  }

  // Collects finished requests and prints progress.
  void poll(StreamClient& client) {
    for (RequestRecord& r : client.take_finished()) {
      if (r.status != grpc::StatusCode::OK) ++errors_;
      records_.push_back(std::move(r));
    }
    if (o_.progress_s <= 0 || Clock::now() < next_progress_) return;
    next_progress_ += seconds(o_.progress_s);
    std::fprintf(stderr, "[%7.1f s] sent %lld, ended %zu (not OK %lld), in flight %lld\n",
                 std::chrono::duration<double>(Clock::now() - t0_).count(), static_cast<long long>(sent_),
                 records_.size(), static_cast<long long>(errors_),
                 static_cast<long long>(client.in_flight()));
  }

  const Options& o_;
  const bool closed_loop_;
  const bool poisson_;
  const TraceFormat format_;         // azure without a trace
  const std::int64_t block_tokens_;  // a Mooncake trace's tokens per hash id, scaled
  const std::vector<TraceRecord> trace_;
  const std::optional<capserve::runtime::Tokenizer> tokenizer_;
  PromptSource prompts_;
  std::optional<PrefixTokens> prefix_;  // a Mooncake trace's prompts
  SizeSource sizes_;
  LengthCaps caps_{{}};  // set once the served context is known
  std::string arrivals_text_;
  Clock::time_point t0_;
  Clock::time_point next_progress_;
  std::int64_t sent_ = 0;
  std::int64_t errors_ = 0;
  std::vector<RequestRecord> records_;
};

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  CLI::App app{
      "capserve-loadgen: streamed load against a CapServe server, with latency, throughput and the "
      "server's MoE figures"};
  capserve::runtime::add_common_flags(app, "capserve-loadgen");
  Options o;
  add_flags(app, o);
  if (const auto bad =
          capserve::runtime::flag_with_empty_value({argv + 1, static_cast<std::size_t>(argc - 1)})) {
    std::fprintf(stderr, "capserve-loadgen: %.*s has an empty value\n", static_cast<int>(bad->size()),
                 bad->data());
    return 2;
  }
  CLI11_PARSE(app, argc, argv);
  try {
    return Run(o).execute();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capserve-loadgen: %s\n", e.what());
    return 2;
  }
}
