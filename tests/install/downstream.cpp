// A downstream program built against the installed headers: greedy next token of a prompt.
#include <pp/stage.hpp>
#include <pp/text/sampler.hpp>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  auto st = pp::Stage::open_full(argv[1], {.threads = 1});
  pp::Sequence seq = st->new_sequence();
  const std::vector<int32_t> prompt = {496, 198, 303, 365, 321, 74, 280};
  std::vector<float> rows(prompt.size() * st->config().n_embd), logits(st->config().n_vocab);
  st->embed(prompt, rows.data());
  st->forward(seq, 0, rows.data(), prompt.size());
  st->head(seq, rows.data() + (prompt.size() - 1) * st->config().n_embd, 1, logits.data());
  std::printf("%d\n", pp::argmax(logits));
  return 0;
}
