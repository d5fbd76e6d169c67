//! Two agents embed 2 000 texts through one hub while one agent is killed (SIGKILL) in the
//! middle of a lease: every text comes back exactly once, with the vector a direct local
//! embed gives.

use std::collections::BTreeSet;

use fantom_sidecar::inference::EmbedOptions;
use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_serve_2000_texts_while_one_is_killed_mid_lease() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let mut doomed = start_agent(dir.path(), &hub, "gpu-a", &[]);
    let _survivor = start_agent(dir.path(), &hub, "gpu-b", &[]);
    hub.wait_for_agent("gpu-a").await;
    hub.wait_for_agent("gpu-b").await;

    let texts = many_texts(2000);
    // The reference: the same model loaded here, one direct local embed.
    let engine = crate::local_support::minilm_engine(dir.path(), crate::local_support::cpu()).await;
    let want = engine
        .embed(texts.clone(), EmbedOptions::default())
        .await
        .unwrap();

    // Four concurrent client requests of 500 texts each.
    let mut requests = Vec::new();
    for (k, chunk) in texts.chunks(500).enumerate() {
        let (http, url) = (hub.http.clone(), hub.url("/v1/embeddings"));
        let body = json!({"model": if k % 2 == 0 { "embedding" } else { "code-embedding" }, "input": chunk});
        requests.push(tokio::spawn(async move {
            let r = http.post(url).json(&body).send().await.unwrap();
            (
                r.status().as_u16(),
                r.json::<serde_json::Value>().await.unwrap(),
            )
        }));
    }

    // Kill gpu-a while it holds a lease and some items were already served.
    eventually("gpu-a holding a lease mid-run", || async {
        let s = hub.status().await;
        let a = s["agents"]
            .as_array()?
            .iter()
            .find(|a| a["id"] == "gpu-a")?
            .clone();
        let served: u64 = s["agents"]
            .as_array()?
            .iter()
            .flat_map(|a| a["providers"].as_array().cloned().unwrap_or_default())
            .map(|p| p["served_items"].as_u64().unwrap_or(0))
            .sum();
        (a["leases"].as_u64()? > 0 && served > 0).then_some(())
    })
    .await;
    doomed.kill();

    let mut providers = BTreeSet::new();
    for (k, request) in requests.into_iter().enumerate() {
        let (status, body) = request.await.unwrap();
        assert_eq!(status, 200, "{body}");
        let data = body["data"].as_array().unwrap();
        assert_eq!(data.len(), 500, "every text exactly once");
        for (i, item) in data.iter().enumerate() {
            assert_eq!(item["index"], i, "in order, no duplicates");
            let got = vector(&item["embedding"]);
            let reference = &want[k * 500 + i];
            let cos = cosine(&got, reference);
            assert!(cos > 0.99999, "text {}: cosine {cos}", k * 500 + i);
            providers.insert(item["provenance"]["agent"].as_str().unwrap().to_string());
        }
    }
    assert!(providers.contains("gpu-b"), "{providers:?}");
    let lost = hub
        .metric("fantom_hub_leases_total{outcome=\"lost\"}")
        .await;
    assert!(
        lost >= 1.0,
        "the kill landed mid-lease ({lost} leases lost)"
    );
    let served = hub.metric("fantom_hub_items_served_total").await;
    assert!(served >= 2000.0);
    let status = hub.status().await;
    assert_eq!(status["requests_waiting"], 0);
    for role in ["embedding", "code-embedding"] {
        assert_eq!(status["roles"][role]["queue_depth"], 0);
        assert_eq!(status["roles"][role]["leases"], 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_leases_in_progress_and_the_rest_waits_for_another_agent() {
    let dir = tempfile::tempdir().unwrap();
    let hub = HubProc::start(dir.path(), None, &[], &[], "hub.log");
    let mut leaving = start_agent(dir.path(), &hub, "gpu-leaving", &[]);
    hub.wait_for_agent("gpu-leaving").await;
    let texts = many_texts(600);
    let (http, url) = (hub.http.clone(), hub.url("/v1/embeddings"));
    let request = tokio::spawn(async move {
        let r = http
            .post(url)
            .json(&json!({"model": "embedding", "input": texts}))
            .send()
            .await
            .unwrap();
        (
            r.status().as_u16(),
            r.json::<serde_json::Value>().await.unwrap(),
        )
    });
    eventually("leases in progress", || async {
        let s = hub.status().await;
        (s["roles"]["embedding"]["leases"].as_u64()? > 0).then_some(())
    })
    .await;
    let exit = leaving.terminate();
    assert!(exit.success(), "clean exit on SIGTERM: {exit:?}");
    let log = std::fs::read_to_string(&leaving.log).unwrap();
    assert!(log.contains("drained and closed"), "{log}");
    // Nothing was taken down with it: its leases finished (or came back), none were lost.
    assert_eq!(
        hub.metric("fantom_hub_leases_total{outcome=\"lost\"}")
            .await,
        0.0
    );
    let waiting = hub.status().await;
    assert!(
        waiting["roles"]["embedding"]["queue_depth"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(waiting["roles"]["embedding"]["leases"], 0);

    let _next = start_agent(dir.path(), &hub, "gpu-next", &[]);
    let (status, body) = request.await.unwrap();
    assert_eq!(status, 200, "{body}");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 600);
    let agents: BTreeSet<&str> = data
        .iter()
        .map(|d| d["provenance"]["agent"].as_str().unwrap())
        .collect();
    assert_eq!(agents, BTreeSet::from(["gpu-leaving", "gpu-next"]));
}
