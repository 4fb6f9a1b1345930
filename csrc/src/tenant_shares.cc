#include "atom_sched/tenant_shares.h"

#include <cmath>

namespace atom_sched {

int32_t TenantShares::join(std::string_view name, double floor) {
  const std::string key(name);
  if (auto it = id_by_name_.find(key); it != id_by_name_.end()) {
    ++live_[it->second];
    return it->second;
  }
  int32_t t;
  if (!free_ids_.empty()) {
    t = free_ids_.back();
    free_ids_.pop_back();
  } else {
    t = static_cast<int32_t>(live_.size());
    name_.emplace_back();
    weight_.push_back(1.0);
    charged_.push_back(0.0);
    live_.push_back(0);
  }
  const auto w = weights_.find(key);
  weight_[t] = w != weights_.end() ? w->second : 1.0;
  // Lifted to the least counter of the others: charged / weight == floor.
  charged_[t] = std::isfinite(floor) ? floor * weight_[t] : 0.0;
  live_[t] = 1;
  name_[t] = key;
  id_by_name_.emplace(key, t);
  return t;
}

void TenantShares::leave(int32_t t) {
  if (--live_[t] > 0) return;
  id_by_name_.erase(name_[t]);
  name_[t].clear();
  charged_[t] = 0.0;
  free_ids_.push_back(t);
}

}  // namespace atom_sched
