// What a qk_norm_rope_cache call's caches store: a runtime field of Params, which each launcher
// turns into its kernel's template argument, and a field of the tuned policy's Call. Plain C++.
#pragma once

namespace cookbook::qk_norm_rope_cache {

enum class CacheDtype : int { kActivation = 0, kFp8E4m3 = 1 };  // the activation dtype, or e4m3 bytes

}  // namespace cookbook::qk_norm_rope_cache
