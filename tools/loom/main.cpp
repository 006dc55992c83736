#include <cstdio>

int main() {
  std::puts("loom");
  return 0;
}
