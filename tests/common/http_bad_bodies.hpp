// Request bodies a client may send wrong, for pp_node --serve's API: each one is refused with a 4xx naming
// the problem or, for the few that are valid after all, accepted; never a 5xx. Used by tests/unit/test_serve_parts.cpp (in-process) and
// tests/contract/test_node_serve.cpp (through the live server).
#pragma once

#include <string>
#include <vector>

namespace pp::test {

inline std::vector<std::string> bad_bodies() {
  std::vector<std::string> b = {
      "", " ", "\n\t", "{", "}", "[", "nul", "{\"prompt\": \"x\",", "{\"prompt\": \"x\"", "{\"prompt\": \"x\"}}", "[]",
      "[1, 2]", "\"prompt\"", "42", "null", "true", "{\"prompt\": \"x\" \"y\"}", "{'prompt': 'x'}",
      std::string("{\"prompt\": \"a\0b\"}", 17), std::string("\0\0\0\0", 4), "{\"prompt\": \"\xff\xfe\"}",
      "{\"prompt\": \"\xc3\x28\"}", "{\"prompt\": \"\\ud800\"}", "{\"prompt\": \"x\", \"temperature\": 1e400}",
      "{\"prompt\": \"x\", \"temperature\": -1e400}", "{\"prompt\": \"x\", \"max_tokens\": 1e400}",
      "{\"prompt\": \"x\", \"top_p\": 1e-400000}", "{\"prompt\": \"x\", \"seed\": 123456789012345678901234567890}",
      "{\"prompt\": \"x\", \"max_tokens\": 123456789012345678901234567890}", "{\"prompt\": \"x\", \"n\": -99999999999999999999}",
      "{\"prompt\": \"x\", \"temperature\": " + std::string(1'000'000, '1') + "}",
      "{\"prompt\": \"x\", \"temperature\": 0." + std::string(100, '0') + "1}",
      "{\"x\": " + std::string(100'000, '[') + std::string(100'000, ']') + ", \"prompt\": \"hi\"}",
      "{\"x\": " + std::string(65, '{') + "}",
      "{\"prompt\": [1, 2, " + std::string(70, '[') + "]}",
      "{\"prompt\": \"x\", \"stop\": " + std::string(10, '[') + std::string(10, ']') + "}",
  };
  // A wrong type at every field the API reads.
  const char* fields[] = {"model", "prompt", "messages", "stream", "stream_options", "return_tokens", "ignore_eos", "n",
                          "best_of", "logprobs", "top_logprobs", "echo", "suffix", "presence_penalty",
                          "frequency_penalty", "logit_bias", "tools", "functions", "response_format", "temperature",
                          "top_p", "top_k", "min_p", "seed", "stop", "max_tokens", "max_completion_tokens", "parse_special"};
  const char* wrong[] = {"\"str\"", "-1", "1.5", "true", "[1, \"a\", null]", "{\"type\": 5, \"text\": 7}", "[[1]]",
                         "{\"include_usage\": \"yes\"}", "[{}]", "1e308"};
  for (const char* f : fields)
    for (const char* w : wrong) {
      // (max_tokens 2: a body that is accepted after all does not generate for long)
      const std::string few = std::string(f).find("max_") == 0 ? "" : "\"max_tokens\": 2, ";
      b.push_back(std::string("{\"prompt\": \"x\", ") + few + "\"" + f + "\": " + w + "}");
      b.push_back(std::string("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], ") +
                  few + "\"" + f + "\": " + w + "}");
    }
  // Messages wrong in every part.
  for (const char* m : {"7", "[7]", "[{}]", "[{\"role\": 7}]", "[{\"role\": \"user\", \"content\": 7}]",
                        "[{\"role\": \"user\", \"content\": [7]}]", "[{\"role\": \"user\", \"content\": [{\"type\": 7}]}]",
                        "[{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": 7}]}]",
                        "[{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]",
                        "[{\"role\": \"user\", \"content\": \"x\", \"tool_calls\": [1]}]", "[{\"role\": \"tool\", \"content\": \"x\"}]",
                        "[{\"role\": \"user\", \"content\": {\"a\": 1}}]"})
    b.push_back(std::string("{\"messages\": ") + m + "}");
  b.push_back("{\"prompt\": [[1, 2], [3]]}");
  b.push_back("{\"prompt\": [\"a\", 1]}");
  b.push_back("{\"prompt\": [1.5]}");
  b.push_back("{\"prompt\": [-1]}");
  b.push_back("{\"prompt\": [18446744073709551615]}");
  b.push_back("{\"prompt\": {}}");
  b.push_back("{\"prompt\": \"\"}");
  return b;
}

}  // namespace pp::test
