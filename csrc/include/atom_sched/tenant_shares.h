// Per-tenant accounting of scheduling="fair" (SchedulingPolicy::kFairShare): a virtual token
// counter per tenant, as the Virtual Token Counter of "Fairness in Serving Large Language Models"
// (Sheng et al., OSDI 2024). A tenant's counter is the tokens computed for it (prompt chunks,
// recomputation after a preemption, decode tokens; prefix-cache hits are free) divided by its
// weight. Admission serves the waiting tenant with the least counter and preemption takes from
// the one with the most, so over any busy period each tenant gets tokens in proportion to its
// weight, whatever the others send.
//
// Only tenants with live requests are kept: one that has none is forgotten, and when it comes
// back it starts at the least counter of the tenants with live requests (the counter is
// "lifted"), so idle time banks no credit. Its memory is bounded by the live requests.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace atom_sched {

class TenantShares {
 public:
  explicit TenantShares(const std::map<std::string, double>& weights = {}) : weights_(weights) {}

  /// A request of tenant `name` is added. `floor` is the least counter among tenants with live
  /// requests (+inf when none): a tenant without live requests starts there. Returns the id.
  int32_t join(std::string_view name, double floor);
  /// Whether tenant `name` has live requests.
  [[nodiscard]] bool has(std::string_view name) const {
    return id_by_name_.count(std::string(name)) > 0;
  }
  /// A live request of tenant `t` ended (finished, aborted, rejected).
  void leave(int32_t t);
  /// Tokens computed for tenant `t` by an admission that has ended (finished or preempted).
  void charge(int32_t t, int64_t tokens) { charged_[t] += static_cast<double>(tokens); }

  [[nodiscard]] int32_t size() const noexcept { return static_cast<int32_t>(live_.size()); }
  [[nodiscard]] bool active(int32_t t) const noexcept { return live_[t] > 0; }
  [[nodiscard]] int32_t live(int32_t t) const noexcept { return live_[t]; }
  [[nodiscard]] double weight(int32_t t) const noexcept { return weight_[t]; }
  /// The tokens charged to `t` so far: add its running admissions' tokens and divide by its
  /// weight for its counter (Scheduler::tenant_counters()).
  [[nodiscard]] double charged(int32_t t) const noexcept { return charged_[t]; }
  [[nodiscard]] int32_t num_active() const noexcept {
    return static_cast<int32_t>(id_by_name_.size());
  }

 private:
  std::map<std::string, double> weights_;  // config: unlisted tenants weigh 1
  std::unordered_map<std::string, int32_t> id_by_name_;  // active tenants only
  std::vector<std::string> name_;   // [id]
  std::vector<double> weight_;      // [id]
  std::vector<double> charged_;     // [id]
  std::vector<int32_t> live_;       // [id]: live requests; 0: the id is free
  std::vector<int32_t> free_ids_;
};

}  // namespace atom_sched
