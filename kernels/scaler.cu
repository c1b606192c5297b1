// The loss-scale update of torch.amp.GradScaler (_amp_update_scale_), with optional
// hysteresis (apex/DeepSpeed), as a one-thread kernel, plus the applied-step counter.
// amp_state = [scale, growth_tracker, hysteresis_left, applied_steps]; stats[0] = found_inf.
#include "multi_tensor.cuh"

extern "C" __global__ void update_scale(float* amp_state, const float* stats, float growth_factor,
                                        float backoff_factor, float growth_interval, float hysteresis,
                                        float min_scale, float max_scale, int dynamic) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const bool found_inf = stats[0] != 0.0f;
    if (!found_inf) amp_state[3] += 1.0f;                       // the optimizer step was applied
    if (!dynamic) return;
    float scale = amp_state[0], tracker = amp_state[1], hyst = amp_state[2];
    if (found_inf) {
        tracker = 0.0f;
        hyst = fmaxf(hyst - 1.0f, 0.0f);
        if (hyst == 0.0f) {                                      // back off
            scale = fmaxf(scale * backoff_factor, min_scale);
            hyst = hysteresis;
        }
    } else {
        tracker += 1.0f;
        if (tracker >= growth_interval) {                        // grow, never to inf
            float grown = scale * growth_factor;
            if (isfinite(grown)) scale = fminf(grown, max_scale);
            tracker = 0.0f;
            hyst = hysteresis;
        }
    }
    amp_state[0] = scale; amp_state[1] = tracker; amp_state[2] = hyst;
}
