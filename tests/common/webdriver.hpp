// Test helper: a headless Chromium driven over the W3C WebDriver protocol (chromedriver, JSON over HTTP with
// httplib), for tests of the page pp_node --serve answers GET / with. No Python or Node: one chromedriver
// process on a loopback port, one browser session in a fresh profile directory.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "node_process.hpp"

namespace pp::test {

// An executable named `name` on PATH (or the env override), else empty.
inline std::string find_program(const char* env, std::initializer_list<const char*> names) {
  if (const char* e = std::getenv(env); e && *e) return ::access(e, X_OK) == 0 ? e : "";
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  for (const char* name : names) {
    std::size_t start = 0;
    while (start <= dirs.size()) {
      const std::size_t end = std::min(dirs.find(':', start), dirs.size());
      const std::filesystem::path p = std::filesystem::path(dirs.substr(start, end - start)) / name;
      if (::access(p.c_str(), X_OK) == 0) return p.string();
      start = end + 1;
    }
  }
  return "";
}

inline std::vector<uint8_t> base64_decode(const std::string& in) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::vector<uint8_t> out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    const int v = value(c);
    if (v < 0) continue;  // '=' padding, line breaks
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(uint8_t(acc >> bits));
    }
  }
  return out;
}

// One chromedriver and one headless browser session. Construct with start(); null plus `why` when
// chromium or chromedriver is not installed (the caller skips). Commands throw std::runtime_error naming
// the command and WebDriver's message.
class Browser {
 public:
  static std::unique_ptr<Browser> start(std::string& why) {
    const std::string driver = find_program("PP_CHROMEDRIVER", {"chromedriver"});
    const std::string chrome = find_program("PP_CHROMIUM", {"chromium", "chromium-browser", "google-chrome"});
    if (driver.empty() || chrome.empty()) {
      why = std::string("no ") + (driver.empty() ? "chromedriver" : "chromium") +
            " on PATH (Debian: apt-get install chromium chromium-driver; or set PP_CHROMEDRIVER / PP_CHROMIUM)";
      return nullptr;
    }
    auto b = std::unique_ptr<Browser>(new Browser);
    char tmpl[] = "/tmp/pp_browser_test.XXXXXX";
    b->profile_ = mkdtemp(tmpl);
    b->port_ = free_port();
    b->driver_ = std::make_unique<Process>(std::vector<std::string>{driver, "--port=" + std::to_string(b->port_)});
    b->http_ = std::make_unique<httplib::Client>("127.0.0.1", b->port_);
    b->http_->set_read_timeout(std::chrono::duration_cast<std::chrono::seconds>(slack(std::chrono::seconds(30))).count());
    const auto deadline = Clock::now() + slack(std::chrono::seconds(10));
    for (;;) {  // chromedriver is up once /status says ready
      if (auto r = b->http_->Get("/status"); r && r->status == 200) break;
      if (!b->driver_->running() || Clock::now() > deadline)
        throw std::runtime_error("chromedriver did not start: " + b->driver_->out() + b->driver_->err());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // Root needs --no-sandbox; a fresh profile keeps runs apart.
    const nlohmann::json caps = {
        {"capabilities",
         {{"alwaysMatch",
           {{"browserName", "chrome"},
            {"goog:chromeOptions",
             {{"binary", chrome},
              {"args",
               {"--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--window-size=1280,800", "--user-data-dir=" + (b->profile_ / "profile").string()}}}}}}}}};
    b->session_ = b->command("POST", "/session", caps).at("sessionId").get<std::string>();
    return b;
  }

  Browser(const Browser&) = delete;
  Browser& operator=(const Browser&) = delete;
  // Ends the session first (chromedriver closes the browser), then chromedriver.
  ~Browser() {
    if (!session_.empty()) http_->Delete(("/session/" + session_).c_str());
    if (driver_) {
      driver_->signal(SIGTERM);
      driver_->wait(std::chrono::seconds(5));
    }
    driver_.reset();
    std::error_code ec;
    std::filesystem::remove_all(profile_, ec);
  }

  void go(const std::string& url) { session("POST", "/url", {{"url", url}}); }

  // The id of the element matching a CSS selector.
  std::string find(const std::string& css) {
    const nlohmann::json v = session("POST", "/element", {{"using", "css selector"}, {"value", css}});
    if (!v.contains(kElement)) throw std::runtime_error("WebDriver: no element '" + css + "': " + v.dump());
    return v[kElement].get<std::string>();
  }
  void type(const std::string& css, const std::string& text) {
    session("POST", "/element/" + find(css) + "/value", {{"text", text}});
  }
  void clear(const std::string& css) { session("POST", "/element/" + find(css) + "/clear", nlohmann::json::object()); }
  void click(const std::string& css) { session("POST", "/element/" + find(css) + "/click", nlohmann::json::object()); }

  // Runs `script` (a function body) in the page and returns its result.
  nlohmann::json eval(const std::string& script) {
    return session("POST", "/execute/sync", {{"script", script}, {"args", nlohmann::json::array()}});
  }

  // Polls `script` until it returns something truthy (not null/false/""/0), up to `timeout` (scaled).
  std::optional<nlohmann::json> wait_for(const std::string& script, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + slack(timeout);
    for (;;) {
      nlohmann::json v = eval(script);
      const bool truthy = !(v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_string() && v.get<std::string>().empty()) ||
                            (v.is_number() && v.get<double>() == 0));
      if (truthy) return v;
      if (Clock::now() > deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // The viewport as PNG, written to `path`.
  void screenshot(const std::filesystem::path& path) {
    const std::vector<uint8_t> png = base64_decode(session("GET", "/screenshot", nullptr).get<std::string>());
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(png.data()), std::streamsize(png.size()));
  }

 private:
  static constexpr const char* kElement = "element-6066-11e4-a52e-4f735466cecf";  // W3C's web element key

  Browser() = default;

  nlohmann::json session(const std::string& method, const std::string& path, const nlohmann::json& body) {
    return command(method, "/session/" + session_ + path, body);
  }

  nlohmann::json command(const std::string& method, const std::string& path, const nlohmann::json& body) {
    const httplib::Result r = method == "GET" ? http_->Get(path.c_str())
                                              : http_->Post(path.c_str(), body.dump(), "application/json");
    if (!r) throw std::runtime_error("WebDriver " + method + " " + path + ": " + httplib::to_string(r.error()));
    nlohmann::json j = nlohmann::json::parse(r->body, nullptr, false);
    if (j.is_discarded() || !j.contains("value"))
      throw std::runtime_error("WebDriver " + method + " " + path + ": HTTP " + std::to_string(r->status) + " " + r->body);
    if (r->status != 200)
      throw std::runtime_error("WebDriver " + method + " " + path + ": " + j["value"].value("error", "") + ": " +
                               j["value"].value("message", ""));
    return j["value"];
  }

  std::filesystem::path profile_;
  uint16_t port_ = 0;
  std::unique_ptr<Process> driver_;
  std::unique_ptr<httplib::Client> http_;
  std::string session_;
};

}  // namespace pp::test
