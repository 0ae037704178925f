// Which rows of a tiered row store (tiered_store.h) stay in DRAM. No TensorFlow.
//
// FrequencyClock: a generalised CLOCK whose weights come from what the table
// knows about each key, not from the cache's own short history:
//   * frequency: the table hints each training lookup with the key's lookup
//     count (Table::FindOrInsert -> Store::Hint). A row's weight on access is
//     HeatOf(freq) = 1 + floor(log2(freq)), capped at kMaxWeight, so a key
//     seen 1,000 times survives ~10 passes of the hand, a key seen once one.
//   * version: a row whose version (last optimizer update) is at or after the
//     newest step the hand has seen minus kRecentSteps gets one more pass when
//     its weight runs out (it is being trained right now).
// The hand visits resident slots in order; each visit takes one unit of
// weight; a slot at zero weight is the victim (if the store can lock it).
//
// A policy is a stateless class of static functions over the per-slot weight
// byte and the per-row heat byte the store keeps; the store is templated on
// it (TieredStore<Policy>), so another policy is another small class.
#pragma once
#include <atomic>
#include <cstdint>

namespace evstore {

struct FrequencyClock {
  static constexpr uint8_t kMaxWeight = 15;
  static constexpr int64_t kRecentSteps = 0;

  // Weight a row earns on access, from its key's lookup count (0: unknown).
  static uint8_t HeatOf(uint32_t freq) {
    if (freq == 0) return 1;
    int lg = 31 - __builtin_clz(freq);
    return static_cast<uint8_t>(1 + lg > kMaxWeight ? kMaxWeight : 1 + lg);
  }
  // On access: the slot's weight rises to the row's heat (never falls).
  static void OnAccess(std::atomic<uint8_t>& weight, uint8_t heat) {
    uint8_t h = heat ? heat : 1;
    if (weight.load(std::memory_order_relaxed) < h) weight.store(h, std::memory_order_relaxed);
  }
  // The hand passes a slot: true when it is a victim candidate (weight 0),
  // else takes one unit of weight.
  static bool Pass(std::atomic<uint8_t>& weight) {
    uint8_t w = weight.load(std::memory_order_relaxed);
    if (w == 0) return true;
    weight.store(w - 1, std::memory_order_relaxed);
    return false;
  }
  // A candidate whose row was updated recently gets one more pass.
  static bool Recent(int64_t version, int64_t newest_step) {
    return version >= 0 && version >= newest_step - kRecentSteps;
  }
};

}  // namespace evstore
